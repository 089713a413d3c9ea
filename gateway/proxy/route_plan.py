"""The config compiled for the request path: one plan per route, built once at start.

Whatever a request needs that depends on the config alone is made here and
only read per request: each route's metric children (with its label), its
upstream base URL and timeouts, the prefix it strips, and for each of its
limits the identity key, the RateLimit-Policy value and the rejection bodies.
`Plans` holds every plan and every cache keyed by them, so a reload can build
new ones and swap a single reference.

Trusts the config, which `gateway.config.loader` has validated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from gateway.access_log import PROCESS_LOG_SECRET
from gateway.config.model import ForwardedHeaders, GatewayConfig, Limit, Match, PathNormalization, Route
from gateway.metrics import UNMATCHED_ROUTE, Children, Metrics
from gateway.proxy.client_identity import ClientIdentity, IdentityKey, RouteIdentity
from gateway.proxy.problem import ProblemTemplate, problem_body
from gateway.proxy.ratelimit_headers import policy
from gateway.proxy.routing import Router


@dataclass(frozen=True, slots=True)
class LimitPlan:
    limit: Limit
    cost: int
    decisions: Children  # gateway_limiter_decisions_total for this route and limit, by decision


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


@dataclass(frozen=True, slots=True)
class RoutePlan:
    match: Match
    label: str  # the route in metrics and the access log
    upstream: str  # base URL, without a trailing slash
    strip: PrefixStrip | None
    preserve_host: bool
    allow_path_parameters: bool
    timeout: aiohttp.ClientTimeout
    limits: tuple[LimitPlan, ...]
    shadowed: bool  # some of the limits are shadow limits, which never reject
    identity: RouteIdentity  # what the limits read, and the headers Connection may not name
    policies: tuple[str, ...]  # RateLimit-Policy of each limit, in order
    upstream_timeout: bytes  # the 504 body
    max_body_size: int | None  # bytes of request body the route takes; more gets 413
    body_too_large: bytes  # the 413 body
    queue_timeout: float  # longest wait for a free connection to the upstream
    queue_full: bytes  # the 503 body when none came free in time
    requests: Children  # gateway_requests_total for this route, by method and status class
    upstream_latency: Children
    # (status, limit names) -> body of a 429 or a fail-closed 503; one per subset of `limits` at most
    _rejections: dict[tuple[int, tuple[str, ...]], ProblemTemplate] = field(default_factory=dict, repr=False)

    def rejection(self, status: int, names: tuple[str, ...]) -> ProblemTemplate:
        """The body of a 429 (its blank: the seconds to wait) or of a fail-closed 503, naming `names`."""
        template = self._rejections.get((status, names))
        if template is None:
            if status == 503:
                template = ProblemTemplate.of(
                    503,
                    "Service Unavailable",
                    "The rate-limit store is unavailable and this limit fails closed.",
                    limits=names,
                )
            else:
                listed = ", ".join(repr(name) for name in names)
                template = ProblemTemplate.of(
                    429, "Too Many Requests", f"Rate limit {listed} exceeded; retry in {{}} s.", limits=names
                )
            self._rejections[(status, names)] = template
        return template


@dataclass(frozen=True, slots=True)
class Plans:
    """Everything the request path reads, compiled from one config."""

    router: Router[RoutePlan]
    path_rule: PathNormalization
    identity: ClientIdentity
    replace_forwarded: bool  # `forwarded_headers: replace`: an untrusted peer's forwarding headers are dropped
    unmatched: Children  # gateway_requests_total for requests no route takes, by method and status class
    upstreams: tuple[str, ...]
    max_in_flight: int
    shed: bytes  # the 503 body past max_in_flight
    log_secret: bytes  # keys the identity hashes in the access log: store.key_secret, else PROCESS_LOG_SECRET


def compile_plans(config: GatewayConfig, metrics: Metrics) -> Plans:
    routes = tuple(_route_plan(route, metrics) for route in config.routes)
    return Plans(
        router=Router(routes),
        path_rule=config.path_normalization,
        identity=ClientIdentity(config.trusted_proxies, config.jwt),
        replace_forwarded=config.forwarded_headers is ForwardedHeaders.REPLACE,
        unmatched=Children(metrics.requests, ("method", "status_class"), route=UNMATCHED_ROUTE),
        upstreams=tuple(sorted({plan.upstream for plan in routes})),
        max_in_flight=config.max_in_flight,
        shed=problem_body(
            503, "Service Unavailable", "The gateway has as many requests in flight as it takes; retry shortly."
        ),
        log_secret=config.store.key_secret.encode() if config.store and config.store.key_secret else PROCESS_LOG_SECRET,
    )


def _route_plan(route: Route, metrics: Metrics) -> RoutePlan:
    label = route.label  # the route in metrics, formed once for all its children
    timeout = route.timeout
    return RoutePlan(
        match=route.match,
        label=label,
        upstream=route.upstream,
        strip=PrefixStrip.of(route.match.path) if route.strip_prefix and route.match.path != "/" else None,
        preserve_host=route.preserve_host,
        allow_path_parameters=route.allow_path_parameters,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout.connect, sock_read=timeout.read),
        limits=tuple(
            LimitPlan(
                limit=rl.limit,
                cost=rl.cost,
                decisions=Children(metrics.decisions, ("decision",), route=label, limit=rl.limit.name),
            )
            for rl in route.limits
        ),
        shadowed=any(rl.limit.shadow for rl in route.limits),
        identity=RouteIdentity.of([IdentityKey.of(rl.limit.key) for rl in route.limits]),
        policies=tuple(policy(rl.limit) for rl in route.limits),
        upstream_timeout=problem_body(
            504,
            "Gateway Timeout",
            f"The upstream did not answer in time (connect {timeout.connect:g} s, read {timeout.read:g} s).",
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
        upstream_latency=Children(metrics.upstream_latency, route=label),
    )
