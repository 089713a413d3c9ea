"""`ShouldRateLimit` of Envoy's rate-limit service (envoy.service.ratelimit.v3), answered by
the gateway's limiter, and the gRPC server that serves it on `rls_listen`.

Each descriptor of a request finds its rate limit (gateway.envoy.descriptors); the limits
found, after `replaces`, go to the limiter in one check, so a request is all or nothing:
when any descriptor is over its limit, none is charged, but those of a rule with
`charge: always`, whose every hit is owed (`LimitCheck.owed`): charged refused or not, into
debt past zero, which is what Envoy's charge after the response needs. Concurrent RPCs go to
the limiter in groups (gateway.envoy.gathering), so that their checks share script calls.
Failure policies, the denial cache and the circuit breaker apply as they do to the proxy's
limits. The cost of a descriptor is its own `hits_addend` when Envoy sets one, else the
request's (0 there means 1, as Envoy and envoyproxy/ratelimit read it). A descriptor with no rate limit is answered OK and counts
nothing, as is every descriptor of a domain the config does not have (a limit override
there too, as envoyproxy/ratelimit ignores it); an empty domain or
descriptor list, or a cost or limit override no bucket can take, is INVALID_ARGUMENT. A
fail-closed limit the store could not check answers OVER_LIMIT: Envoy would otherwise let
an error through unless its own `failure_mode_deny` is set.

Trusts Envoy no further than any client: it reaches the limiter only through the config's
rate limits, its descriptor values are identities (hashed by the store like any other), and
a frame that is no RateLimitRequest never reaches this code (grpcio answers it with a
status). Nothing here imports the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gateway.config.model import FailurePolicy, GatewayConfig, Limit, RlsConfig, RlsRateLimit
from gateway.config.reader import MAX_COUNT
from gateway.config.rls import UNIT_SECONDS, override_limit
from gateway.decision.core import Decider
from gateway.envoy.bounds import frame_fault, grpc_options, request_fault
from gateway.envoy.descriptors import identity_of, rate_limit_of, request_over_limit, without_replaced
from gateway.envoy.gathering import Gathering
from gateway.envoy.generated import rls_pb2
from gateway.limiter.decision import Decision, LimitStatus, local_share
from gateway.limiter.outcomes import ALLOW, DENY, FAIL_CLOSED, FAIL_LOCAL, FAIL_OPEN, NO_ROOM, SHADOW_LIMITED, SKIPPED
from gateway.limiter.store import LimitCheck
from gateway.ratelimit_headers import RateLimitFields

log = logging.getLogger(__name__)

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
Response = rls_pb2.RateLimitResponse
OK, OVER_LIMIT = Response.Code.OK, Response.Code.OVER_LIMIT
UNITS = {name: Response.RateLimit.Unit.Value(name.upper()) for name in UNIT_SECONDS}
OVERRIDE_UNITS = {Response.RateLimit.Unit.Value(name.upper()): name for name in UNIT_SECONDS}
# What limit_remaining (a uint32) can carry.
MAX_REMAINING = 2**32 - 1
# Overrides seen, each its own Limit: bounded, since Envoy's route config (not a client)
# chooses them, but a bound keeps a misconfigured Envoy from growing this without end.
MAX_OVERRIDES = 1024
# Outcomes that say the limit refused: a denial, or a fail-closed limit the store could not check.
REFUSED = frozenset({DENY, FAIL_CLOSED, NO_ROOM})
# The metric's labels for what the limiter did not decide.
UNKNOWN_DOMAIN, UNMATCHED = "unknown", "unmatched"
EXPORTED_DECISIONS = (ALLOW, DENY, SKIPPED, SHADOW_LIMITED, FAIL_OPEN, FAIL_CLOSED, FAIL_LOCAL, NO_ROOM, UNMATCHED)
# On a stop without a drain, RPCs in flight get this long to finish; the limiter answers within a store timeout.
STOP_GRACE = 1.0
# RPCs shed in a flood; one line a second says enough.
SHED_LOG_INTERVAL = 1.0


class InvalidRequest(Exception):
    """A request the service cannot answer; str() is the status detail."""


class RateLimitService:
    """The limiter behind `ShouldRateLimit`, for one config (swapped on reload)."""

    def __init__(self, config: GatewayConfig, decider: Decider, counted: Any) -> None:
        """`counted`: gateway_rls_descriptors_total, labelled by domain and decision."""
        self.decider = decider
        self.limiter = decider.limiter
        self._counted = counted
        # Its children by (domain, decision), looked up once each: a handful of domains and outcomes.
        self._counts: dict[tuple[str, str], Any] = {}
        self.reload(config)
        self._overrides: dict[tuple[str, int, str], Limit] = {}
        self._gathering = Gathering()

    def reload(self, config: GatewayConfig) -> None:
        assert config.rls is not None
        self.rls: RlsConfig = config.rls
        self.local_divisor = config.local_divisor
        for domain in (*self.rls.domains, UNKNOWN_DOMAIN):  # exported at 0 from the start
            for decision in EXPORTED_DECISIONS:
                self._count(domain, decision)

    async def should_rate_limit(self, request: Any, *, shed: bool = False) -> Any:
        """The RateLimitResponse for a RateLimitRequest (within gateway.envoy.bounds). Raises
        InvalidRequest. `shed`: the failure policies answer, without the store."""
        if not request.domain:
            raise InvalidRequest("rate limit domain must not be empty")
        if not request.descriptors:
            raise InvalidRequest("rate limit descriptor list must not be empty")
        default_cost = request.hits_addend or 1
        known = request.domain in self.rls.domains
        found: list[RlsRateLimit | None] = []
        keyed: list[Sequence[tuple[str, str]]] = []  # the entries each bucket is keyed by
        costs: list[int] = []
        for descriptor in request.descriptors:
            entries = [(entry.key, entry.value) for entry in descriptor.entries]
            cost = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else default_cost
            if cost > MAX_COUNT:
                raise InvalidRequest(f"hits_addend {cost} is more than any bucket holds ({MAX_COUNT})")
            costs.append(cost)
            rate_limit: RlsRateLimit | None
            bucket_entries: Sequence[tuple[str, str]] = entries
            if not known:  # as envoyproxy/ratelimit: an unknown domain has no limits, overrides included
                rate_limit = None
            elif descriptor.HasField("limit"):
                rate_limit = self._override(request.domain, descriptor.limit)
            else:
                rate_limit, bucket_entries = rate_limit_of(self.rls.domains, request.domain, entries)
            found.append(rate_limit)
            keyed.append(bucket_entries)
        # Unlimited before `replaces`: an unlimited descriptor answers so even when replaced.
        unlimited = [rl is not None and rl.limit is None for rl in found]
        found = without_replaced(found)
        checks: list[LimitCheck] = []
        slots: list[int | None] = []  # per descriptor: its check, None when it has no limit
        seen: dict[tuple[int, str], int] = {}  # (limit, identity) -> its check
        for rate_limit, bucket_entries, cost in zip(found, keyed, costs):
            limit = rate_limit.limit if rate_limit is not None else None
            if limit is not None:
                # A quota-mode descriptor's hits are owed too: the reference's token-quota pattern.
                owed = rate_limit is not None and (rate_limit.charge_always or rate_limit.quota_mode)
                check = LimitCheck(limit=limit, identity=identity_of(bucket_entries), cost=cost, owed=owed)
                slots.append(_add(checks, seen, check))
            else:
                slots.append(None)
        if checks and not shed:  # with the RPCs about it, into shared script calls
            await self._gathering.wait()
        decision = await self.decider.check(checks, shadowed=any(c.limit.shadow for c in checks), shed=shed)
        if not decision.allowed and not shed:
            decision = await self._read_unasked(checks, decision)
        domain = request.domain if known else UNKNOWN_DOMAIN
        for slot in slots:
            self._count(domain, UNMATCHED if slot is None else decision.statuses[slot].outcome).inc()
        return self._response(found, unlimited, slots, checks, decision)

    def _count(self, domain: str, decision: str) -> Any:
        """The counter of `decision` for `domain`."""
        child = self._counts.get((domain, decision))
        if child is None:
            child = self._counts[domain, decision] = self._counted.labels(domain=domain, decision=decision)
        return child

    async def _read_unasked(self, checks: Sequence[LimitCheck], decision: Decision) -> Decision:
        """`decision` with what the store holds for the limits it was not asked about (a cached
        denial of another limit answered, or an earlier Cluster slot refused): one read of
        them (cost 0, charging nothing), so their descriptors say their true numbers."""
        unasked = [i for i, s in enumerate(decision.statuses) if s.outcome == SKIPPED and s.remaining is None]
        if not unasked:
            return decision
        read = await self.limiter.check([dataclasses.replace(checks[i], cost=0) for i in unasked])
        statuses = list(decision.statuses)
        for i, found in zip(unasked, read.statuses):
            if found.remaining is not None and found.outcome in (ALLOW, DENY):
                # A bucket found in debt refuses on its own (an owed charge ran it below zero).
                outcome = DENY if found.outcome == DENY else SKIPPED
                statuses[i] = dataclasses.replace(statuses[i], remaining=found.remaining, reset=found.reset, outcome=outcome)
        return dataclasses.replace(decision, statuses=tuple(statuses))

    def _override(self, domain: str, override: Any) -> RlsRateLimit:
        unit = OVERRIDE_UNITS.get(override.unit)
        if unit is None or not override.requests_per_unit:
            raise InvalidRequest("a limit override needs requests_per_unit of at least 1 and a unit from SECOND to YEAR")
        key = (domain, override.requests_per_unit, unit)
        limit = self._overrides.get(key)
        if limit is None:
            if len(self._overrides) >= MAX_OVERRIDES:
                self._overrides.clear()
            limit = self._overrides[key] = override_limit(domain, override.requests_per_unit, unit)
        return RlsRateLimit(limit=limit, unit=unit, requests_per_unit=override.requests_per_unit)

    def _response(
        self,
        found: Sequence[RlsRateLimit | None],
        unlimited: Sequence[bool],
        slots: Sequence[int | None],
        checks: Sequence[LimitCheck],
        decision: Decision,
    ) -> Any:
        """The answer, as envoyproxy/ratelimit words it: an unmatched or replaced descriptor is
        OK with no `current_limit` and 0 remaining, an unlimited one OK with no `current_limit`
        and 2^32 - 1 remaining; every limit checked says its numbers, refused or not."""
        answered: list[LimitStatus] = []
        response = Response()
        for rate_limit, is_unlimited, slot in zip(found, unlimited, slots):
            status = response.statuses.add()
            status.code = OK
            if is_unlimited:
                status.limit_remaining = MAX_REMAINING
            if rate_limit is None or slot is None:  # unmatched, replaced or unlimited
                continue
            check, limit_status = checks[slot], decision.statuses[slot]
            answered.append(limit_status)
            # A quota-mode limit is checked as a shadow one: its refusal is the shadow's. A
            # local stand-in's refusal is a denial too.
            refused = (
                limit_status.outcome in REFUSED
                or (rate_limit.quota_mode and limit_status.outcome == SHADOW_LIMITED)
                or (not decision.allowed and _short_locally(limit_status, check.owed))
            )
            status.code = OVER_LIMIT if refused else OK
            status.current_limit.requests_per_unit = rate_limit.requests_per_unit
            status.current_limit.unit = UNITS[rate_limit.unit]
            status.current_limit.name = rate_limit.name
            over = refused or limit_status.outcome == SHADOW_LIMITED
            remaining, reset = _remaining_and_reset(self._applied(limit_status), limit_status, over=over, owed=check.owed)
            status.limit_remaining = remaining
            status.duration_until_reset.seconds = reset
        refused = request_over_limit(found, [s.code == OVER_LIMIT for s in response.statuses])
        response.overall_code = OVER_LIMIT if refused else OK
        if answered:
            pairs = [(s.limit, self._applied(s)) for s in answered]
            for name, value in RateLimitFields.of(pairs, self.local_divisor).headers(answered).items():
                response.response_headers_to_add.add(key=name, value=value)
        return response

    def _applied(self, status: LimitStatus) -> Limit:
        """What decided `status`: the limit, or its share under `on_store_error: local`."""
        limit = status.limit
        if limit.on_store_error is FailurePolicy.LOCAL:
            return local_share(limit, self.local_divisor, status.cost)
        return limit


def _add(checks: list[LimitCheck], seen: dict[tuple[int, str], int], check: LimitCheck) -> int:
    """Where `check` is in `checks`: a descriptor whose bucket an earlier one of the request
    names adds its cost to that check, as envoyproxy/ratelimit counts both hits."""
    key = (id(check.limit), check.identity)
    i = seen.get(key)
    if i is None:
        seen[key] = len(checks)
        checks.append(check)
        return len(checks) - 1
    cost = checks[i].cost + check.cost
    if cost > MAX_COUNT:
        raise InvalidRequest(f"hits_addend {cost} is more than any bucket holds ({MAX_COUNT})")
    checks[i] = dataclasses.replace(checks[i], cost=cost)
    return i


def _short_locally(status: LimitStatus, owed: bool) -> bool:
    """Whether the local stand-in (`on_store_error: local`) could not pay: short of the cost,
    or for an owed charge, whose remaining is after it, below 0."""
    if status.outcome == FAIL_LOCAL and owed:
        return status.remaining is not None and status.remaining < 0
    return status.denied


def _remaining_and_reset(limit: Limit, status: LimitStatus, *, over: bool, owed: bool) -> tuple[int, int]:
    """limit_remaining and duration_until_reset, in whole tokens and seconds (0: unknown).

    envoyproxy/ratelimit counts fixed windows, where both numbers come from one count: what
    is left of the window, and the seconds until it ends, when a refused request passes and
    the whole limit is back. A token bucket splits the two, so a limit that refuses (`over`,
    a shadow limit too) says 0 left, as the reference does, and the seconds until this
    request's cost could pass (an owed charge's: until a read passes, the bucket out of
    debt); one that does not says the whole tokens it holds and the seconds until it is full
    again, as the proxy's X-RateLimit-Reset. A quota (`fixed_window`) says its window's end."""
    held = status.remaining
    if held is None:
        return 0, 0
    remaining = 0 if over else min(MAX_REMAINING, math.floor(max(0.0, held)))
    if status.reset is not None:
        return remaining, math.ceil(status.reset)
    rate = limit.rate.per_second
    if over:
        need = 0.0 if owed else status.cost
        if need <= limit.burst:
            return remaining, math.ceil(max(0.0, need - held) / rate)
    return remaining, math.ceil(max(0.0, limit.burst - held) / rate)


def _request_of(data: bytes) -> Any:
    """The RateLimitRequest in a frame, or the InvalidRequest that refuses it: grpcio would log
    a traceback for a frame protobuf cannot parse, and answer it with a status that says
    nothing of why. The frame's size is checked before protobuf spends time on it."""
    fault = frame_fault(len(data))
    if fault is not None:
        return InvalidRequest(fault)
    try:
        request = rls_pb2.RateLimitRequest.FromString(data)
    except DecodeError:
        return InvalidRequest("not a RateLimitRequest")
    fault = request_fault(request, len(data))
    return request if fault is None else InvalidRequest(fault)


class _Servicer:
    """grpcio's side: a request the service refuses becomes its gRPC status, and one that
    finds `max_in_flight()` RPCs in flight is answered by its rules' failure policies,
    without the store: an error status would be Envoy's to decide (failure_mode_deny)."""

    def __init__(self, service: RateLimitService, max_in_flight: Callable[[], int], on_shed: Callable[[], None]) -> None:
        self._service = service
        self._max_in_flight = max_in_flight
        self._on_shed = on_shed
        self._in_flight = 0
        self._last_shed_log = -SHED_LOG_INTERVAL

    async def should_rate_limit(self, request: Any, context: Any) -> Any:
        try:
            if isinstance(request, InvalidRequest):
                raise request
            if self._in_flight >= self._max_in_flight():
                self._on_shed()
                self._log_shed()
                return await self._service.should_rate_limit(request, shed=True)
            self._in_flight += 1
            try:
                return await self._service.should_rate_limit(request)
            finally:
                self._in_flight -= 1
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _log_shed(self) -> None:
        now = time.monotonic()
        if now - self._last_shed_log >= SHED_LOG_INTERVAL:
            self._last_shed_log = now
            log.warning("%d RPCs in flight (max_in_flight): failure policies answer the next ones", self._in_flight)


class RlsServer:
    """The service's gRPC server, bound: its port, and its stop for a drain."""

    def __init__(self, server: Any, port: int) -> None:
        self._server = server
        self.port = port
        self._stopping: Any = None

    async def stop(self, grace: float) -> None:
        """Refuse new RPCs (UNAVAILABLE, so Envoy asks another instance) and give those in
        flight up to `grace`; a second call waits for the first."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._server.stop(grace))
        await asyncio.shield(self._stopping)


@contextlib.asynccontextmanager
async def serving(
    service: RateLimitService,
    host: str,
    port: int,
    *,
    max_in_flight: Callable[[], int],
    on_shed: Callable[[], None],
    reuse_port: bool = False,
) -> AsyncIterator[RlsServer]:
    """Serve `service` on host:port until the block ends (or its stop); yields it bound. Raises
    OSError when the address cannot be bound. `max_in_flight`: the RPCs in flight past which
    the failure policies answer (read on each RPC, so a reload changes it); `on_shed` is told
    of each. `reuse_port`: every worker binds the same port."""
    # maximum_concurrent_rpcs stays None: grpcio would answer RESOURCE_EXHAUSTED past it.
    server = grpc.aio.server(options=grpc_options(reuse_port=reuse_port), maximum_concurrent_rpcs=None)
    method = grpc.unary_unary_rpc_method_handler(
        _Servicer(service, max_in_flight, on_shed).should_rate_limit,
        request_deserializer=_request_of,
        response_serializer=Response.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ShouldRateLimit": method}),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio's way of saying the port cannot be bound
        raise OSError(f"{exc}") from None
    if not bound and port:
        raise OSError(f"cannot bind {address}")
    await server.start()
    serving = RlsServer(server, bound)
    try:
        yield serving
    finally:
        await serving.stop(STOP_GRACE)
