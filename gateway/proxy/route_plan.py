"""The config compiled for the request path: one plan per route, built once at start.

Whatever a request needs that depends on the config alone is made here and
only read per request: metric children, the upstream and its timeouts, header
and Location rewrites, rate-limit fields, each limit's identity key and
rejection, a pool's balancer, and the gateway's fixed answers serialised with
their headers (`gateway.proxy.problem.Problem`). `Plans` holds every plan and
every cache keyed by them, so a reload builds new ones and swaps a single
reference.

Trusts the config, which `gateway.config.loader` has validated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.http_names import cgi_name
from gateway.config.model import (
    ForwardedHeaders,
    GatewayConfig,
    HeaderRules,
    Match,
    PathNormalization,
    Route,
)
from gateway.config.pool_model import Balance, UpstreamPool
from gateway.config.redaction import redacted_url
from gateway.decision.plan import DecisionPlan
from gateway.decision.problems import problem_body
from gateway.identity.sources import ClientIdentity, IdentityKey, RouteIdentity
from gateway.limiter.keys import PROCESS_SECRET
from gateway.limiter.limiter import Limiter
from gateway.metrics import NO_TARGET, QUEUE_FULL, UNMATCHED_ROUTE, Children, Metrics
from gateway.proxy.headers import GATEWAY_WRITTEN
from gateway.proxy.location import LocationRewrite
from gateway.proxy.problem import Problem
from gateway.proxy.routing import Router
from gateway.proxy.upstreams import Upstream
from gateway.upstream.balancing import Balancer, Outcome, TargetState

_NO_RULES = HeaderRules()  # a route without request_headers or response_headers


@dataclass(frozen=True, slots=True)
class PrefixStrip:
    """A route's `strip_prefix`: how many segments its path prefix has."""

    segments: int

    @classmethod
    def of(cls, prefix: str) -> PrefixStrip:
        return cls(segments=prefix.count("/"))

    def rest(self, forward: str) -> str:
        """`forward` (a NormalPath's) without the prefix. Its segments are those of the
        `match` the prefix matched, one for one, so the prefix is its first `segments`
        segments, parameters and all; an encoded slash never counts as a separator."""
        parts = forward.split("/", self.segments + 1)
        return "/" + parts[-1] if len(parts) > self.segments + 1 else "/"


class _Uncounted:
    """The metric children of a route's single upstream, which has no target series."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def __call__(self, *values: str) -> _Uncounted:
        return self


UNCOUNTED = _Uncounted()


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """One target of a pool (a route's single upstream is a pool of one): its shared state
    and its metric children."""

    url: str  # base URL, without a trailing slash
    name: str  # its label in metrics and logs
    label: str | None  # in the access log's upstream_target: None for a single upstream
    where: str  # the target as the log names it
    state: TargetState
    upstream: Upstream  # its slots and connections, the proxy handler's, kept across reloads
    requests: Any  # gateway_upstream_target_requests_total child
    latency: Any  # gateway_upstream_target_latency_seconds child
    errors: Children  # gateway_upstream_target_errors_total, by kind
    ejections: Any  # gateway_upstream_target_ejections_total child


@dataclass(frozen=True, slots=True)
class PoolPlan:
    targets: tuple[TargetPlan, ...]
    balancer: Balancer  # shared by the routes naming the same pool, so they rotate together
    retries: int
    no_target: Problem  # the 503 when no target is in rotation


@dataclass(frozen=True, slots=True)
class RoutePlan:
    match: Match
    label: str  # the route in metrics and the access log
    upstream: str  # base URL, without a trailing slash; "" for a pool, whose targets are in `pool`
    strip: PrefixStrip | None
    request_headers: HeaderRules | None  # None: the route rewrites no request header
    response_headers: HeaderRules | None
    # CGI names (http_names.cgi_name) of the request headers the route removes or sets and the
    # gateway writes: a line that only reads as one of them (`X_Forwarded_For`) is dropped.
    cgi_written: frozenset[str]
    locations: LocationRewrite  # the upstream's own address in Location and Content-Location
    preserve_host: bool
    allow_path_parameters: bool
    connect_timeout: float
    read_timeout: float
    decision: DecisionPlan  # its limits, compiled for the decision core
    identity: RouteIdentity  # what the limits read, and the headers Connection may not name
    upstream_timeout: bytes  # the 504 body
    max_body_size: int | None  # bytes of request body the route takes; more gets 413
    body_too_large: bytes  # the 413 body
    queue_timeout: float  # longest wait for a free connection to the upstream
    queue_full: bytes  # the 503 body when none came free in time
    requests: Children  # gateway_requests_total for this route, by method and status class
    upstream_latency: Children
    client_closed: Children  # gateway_client_closed_requests_total for this route
    unavailable: Children  # gateway_upstream_unavailable_total for this route, by reason (NO_TARGET, QUEUE_FULL)
    concurrency_identity: RouteIdentity  # what the concurrency limits read
    pool: PoolPlan  # a single upstream is a pool of one target, without ejection
    total_timeout: float | None  # timeout.total: the whole exchange, retries included
    retried: Any  # gateway_upstream_retries_total child


@dataclass(frozen=True, slots=True)
class Plans:
    """Everything the request path reads, compiled from one config."""

    router: Router[RoutePlan]
    path_rule: PathNormalization
    identity: ClientIdentity
    replace_forwarded: bool  # `forwarded_headers: replace`: an untrusted peer's forwarding headers are dropped
    unmatched: Children  # gateway_requests_total for requests no route takes, by method and status class
    upstreams: tuple[str, ...]  # every base URL a request may go to, pool targets included
    pool_targets: tuple[TargetPlan, ...]  # each target of every pool, once
    route_labels: frozenset[str]  # each route as metrics label it
    limit_names: frozenset[str]  # each limit some route applies, rate and concurrency limits alike
    max_in_flight: int
    max_delayed: int  # requests one worker holds waiting out a mode: delay wait
    shed: Problem  # the 503 past max_in_flight
    not_found: Problem  # the 404 for a request no route takes
    log_secret: bytes  # keys the identity hashes in the access log: store.key_secret, else PROCESS_SECRET


def compile_plans(
    config: GatewayConfig,
    metrics: Metrics,
    states: Mapping[str, TargetState],
    limiter: Limiter,
    upstream_for: Callable[[str], Upstream],
) -> Plans:
    """`states`: the shared state of each pool target by URL (gateway.upstream.balancing.TargetStates);
    `limiter` prepares each limit's checks; `upstream_for` gives the upstream of a base URL,
    made if no config named it before."""
    pools: dict[UpstreamPool, PoolPlan] = {}
    targets: dict[str, TargetPlan] = {}
    for route in config.routes:
        if isinstance(route.upstream, UpstreamPool) and route.upstream not in pools:
            pools[route.upstream] = _pool_plan(route.upstream, metrics, states, targets, upstream_for)
    local_divisor = config.local_divisor
    routes = tuple(_route_plan(route, metrics, pools, local_divisor, limiter, upstream_for) for route in config.routes)
    return Plans(
        router=Router(routes),
        path_rule=config.path_normalization,
        identity=ClientIdentity(config.trusted_proxies, config.jwt, config.client_ip, config.identity_max_length),
        replace_forwarded=config.forwarded_headers is ForwardedHeaders.REPLACE,
        unmatched=Children(metrics.requests, ("method", "status_class"), route=UNMATCHED_ROUTE),
        upstreams=tuple(sorted({target.url for plan in routes for target in plan.pool.targets})),
        pool_targets=tuple(targets.values()),
        route_labels=frozenset(plan.label for plan in routes),
        limit_names=frozenset(
            name for route in config.routes for name in (*(rl.limit.name for rl in route.limits), *(c.name for c in route.concurrency))
        ),
        max_in_flight=config.max_in_flight,
        max_delayed=config.max_delayed,
        shed=Problem.of(
            503, "Service Unavailable", "The gateway has as many requests in flight as it takes; retry shortly."
        ),
        not_found=Problem.of(404, "Not Found", "No route matches this request."),
        log_secret=config.store.key_secret.encode() if config.store and config.store.key_secret else PROCESS_SECRET,
    )


def _pool_plan(
    pool: UpstreamPool,
    metrics: Metrics,
    states: Mapping[str, TargetState],
    targets: dict[str, TargetPlan],
    upstream_for: Callable[[str], Upstream],
) -> PoolPlan:
    plans = []
    for target in pool.targets:
        plan = targets.get(target.url)
        if plan is None:
            plan = targets[target.url] = TargetPlan(
                url=target.url,
                name=target.name,
                label=target.name,
                where=f"target {target.name}",
                state=states[target.url],
                upstream=upstream_for(target.url),
                requests=metrics.target_requests.labels(target=target.name),
                latency=metrics.target_latency.labels(target=target.name),
                errors=Children(metrics.target_errors, ("kind",), target=target.name).export(*_ERROR_KINDS),
                ejections=metrics.target_ejections.labels(target=target.name),
            )
        plans.append(plan)
    return PoolPlan(
        targets=tuple(plans),
        balancer=Balancer([p.state for p in plans], [t.weight for t in pool.targets], pool.balance),
        retries=pool.retries,
        no_target=_NO_TARGET,
    )


# The kinds of failed attempt a target can have: its gateway_upstream_target_errors_total series.
_ERROR_KINDS = tuple((outcome.value,) for outcome in Outcome if outcome is not Outcome.ANSWERED)
_NO_TARGET = Problem.of(503, "Service Unavailable", "No upstream target is in rotation; retry shortly.")


def _single_pool(url: str, upstream: Upstream) -> PoolPlan:
    """A route's one upstream as a pool of one target, never ejected, counted in no target series."""
    state = TargetState(None, None)
    target = TargetPlan(
        url=url, name=url, label=None, where=redacted_url(url), state=state, upstream=upstream,
        requests=UNCOUNTED, latency=UNCOUNTED, errors=UNCOUNTED, ejections=UNCOUNTED,  # type: ignore[arg-type]
    )
    return PoolPlan(
        targets=(target,),
        balancer=Balancer([state], [1], Balance.ROUND_ROBIN),
        retries=0,
        no_target=_NO_TARGET,  # never answered: a target without ejection or health checks stays in rotation
    )


def _cgi_written(rules: HeaderRules) -> frozenset[str]:
    """The CGI names of the request headers the gateway removes or writes, each of which a
    client could otherwise send spelt with `_` for a WSGI upstream to read as the real one."""
    names = (*GATEWAY_WRITTEN, "x-request-id", *rules.remove, *(name for name, _ in rules.set))
    return frozenset(cgi_name(name) for name in names if "-" in name or "_" in name)


def _route_plan(
    route: Route,
    metrics: Metrics,
    pools: Mapping[UpstreamPool, PoolPlan],
    local_divisor: int,
    limiter: Limiter,
    upstream_for: Callable[[str], Upstream],
) -> RoutePlan:
    label = route.label  # the route in metrics, formed once for all its children
    timeout = route.timeout
    upstream = route.upstream
    pool = pools[upstream] if isinstance(upstream, UpstreamPool) else _single_pool(upstream, upstream_for(upstream))
    stripped = route.strip_prefix and route.match.path != "/"  # strip_prefix is only taken on prefix routes
    # A pool's targets are each the upstream's own address, for the Location rewrite.
    addresses = [t.url for t in route.upstream.targets] if isinstance(route.upstream, UpstreamPool) else [route.upstream]
    return RoutePlan(
        match=route.match,
        label=label,
        upstream="" if isinstance(route.upstream, UpstreamPool) else route.upstream,
        strip=PrefixStrip.of(route.match.path) if stripped else None,
        request_headers=route.request_headers if route.request_headers != _NO_RULES else None,
        response_headers=route.response_headers if route.response_headers != _NO_RULES else None,
        cgi_written=_cgi_written(route.request_headers),
        locations=LocationRewrite.of(addresses, route.match.path if stripped else None, route.match.host),
        preserve_host=route.preserve_host,
        allow_path_parameters=route.allow_path_parameters,
        connect_timeout=timeout.connect,
        read_timeout=timeout.read,
        decision=DecisionPlan.of(route.limits, route.concurrency, label, metrics, local_divisor, limiter),
        identity=RouteIdentity.of([IdentityKey.of(rl.limit.key) for rl in route.limits], route.match.path),
        upstream_timeout=problem_body(
            504,
            "Gateway Timeout",
            f"The upstream did not answer in time (connect {timeout.connect:g} s, read {timeout.read:g} s"
            + (f", total {timeout.total:g} s)." if timeout.total is not None else ")."),
        ),
        max_body_size=route.max_body_size,
        body_too_large=problem_body(
            413, "Content Too Large", f"This route takes request bodies of {route.max_body_size} bytes at most."
        ),
        queue_timeout=timeout.queue,
        queue_full=problem_body(
            503,
            "Service Unavailable",
            f"No connection to the upstream came free within {timeout.queue:g} s; retry shortly.",
        ),
        requests=Children(metrics.requests, ("method", "status_class"), route=label),
        upstream_latency=Children(metrics.upstream_latency, route=label).export(()),
        client_closed=Children(metrics.client_closed, route=label).export(()),
        unavailable=Children(metrics.upstream_unavailable, ("reason",), route=label).export(
            (QUEUE_FULL,), *([(NO_TARGET,)] if isinstance(route.upstream, UpstreamPool) else [])
        ),
        pool=pool,
        total_timeout=timeout.total,
        retried=metrics.retries.labels(route=label) if isinstance(route.upstream, UpstreamPool) else UNCOUNTED,
        concurrency_identity=RouteIdentity.of([IdentityKey.of(limit.key) for limit in route.concurrency], route.match.path),
    )
