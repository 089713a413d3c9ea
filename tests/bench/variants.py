"""What the benchmark compares, and how each is started.

Every proxy variant but the floor of a denial (h), which answers 429 itself,
forwards `GET /` to the same nginx upstream. The two decision services, the
decision listener asked as Traefik's forwardAuth asks (i) and Envoy's gRPC
rate-limit service (j), forward nothing: each answer is a decision, on the same
Redis and the same all-allowed limit as (b). Each has its floor in the same rounds,
asked the same questions: aiohttp's `web.Server` answering a prebuilt 200 for (i),
grpc.aio answering a prebuilt OK for (j). The gateways run as users start
them, `python -m gateway run -c FILE`, with the project's default store settings
(a 10 ms store timeout included), so the numbers are the ones a user would see.
"""

from __future__ import annotations

import collections
import contextlib
import re
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.bench.servers import (
    ListeningProcess,
    ceiling_proxy,
    decision_floor,
    denial_floor,
    naive_proxy,
    nginx_limit_req_proxy,
    rls_floor,
    started,
)
from tests.processes import GatewayProcess, RedisServer, free_port

# Rate and burst no client comes near in a run: every request is allowed, so what
# is measured is the cost of checking, not of denying.
ALL_ALLOWED_LIMIT = "{rate: 1000000/second, burst: 1000000, key: ['header:X-API-Key']}"
# (b)'s limit with its cost read from the response: 2 reserved before forwarding, and the
# upstream's `X-Usage-Units: 1` settled after it, so each request also refunds 1 (a
# settlement equal to its reservation sends nothing, and would hide the second call).
COSTED_LIMIT = (
    "{rate: 1000000/second, burst: 1000000, key: ['header:X-API-Key'], "
    "cost: {from: 'header:X-Usage-Units', reserve: 2, missing: 2}}"
)
# One token an hour: after the first request, a flooding client is denied for the whole run.
FLOOD_LIMIT = "{rate: 1/hour, burst: 1, key: ['header:X-API-Key'], on_store_error: open}"
FLOOD_API_KEY = "flood"
# The decision services each variant of them measures (Variant.decides).
TRAEFIK_DECISIONS = "traefik"  # wrk at the decision listener's /decide/traefik
RLS_DECISIONS = "rls"  # gRPC ShouldRateLimit (tests.bench.rls_clients)
# ALL_ALLOWED_LIMIT in envoyproxy/ratelimit's format: a key without a value, so each
# descriptor value (one per client) has a bucket of its own, and none is ever refused.
RLS_DOMAIN = "bench"
RLS_DESCRIPTOR_KEY = "client"
RLS_CONFIG = f"""domain: {RLS_DOMAIN}
descriptors:
  - key: {RLS_DESCRIPTOR_KEY}
    rate_limit: {{unit: second, requests_per_unit: 1000000}}
"""
LIMITER_DECISIONS = "gateway_limiter_decisions_total"
# The RLS counts its decisions per descriptor here, not in LIMITER_DECISIONS, which is per route.
RLS_DESCRIPTOR_DECISIONS = "gateway_rls_descriptors_total"
_EVENT_LOOP = re.compile(r"event loop: (\w+)")


@dataclass(frozen=True)
class Environment:
    """What all variants share: the tools, the upstream, one private Redis, a temp dir."""

    tools: dict[str, str]
    upstream_url: str
    redis: RedisServer
    work_dir: Path


@dataclass
class RunningVariant:
    url: str  # what the load goes to; for the RLS, its gRPC target (host:port)
    gateway: GatewayProcess | None = None  # for /metrics and the startup line
    decisions_metric: str = LIMITER_DECISIONS

    def limiter_decisions(self) -> collections.Counter[str]:
        """The gateway's decisions counter (`gateway_limiter_decisions_total`, or the RLS's
        `gateway_rls_descriptors_total`), summed by decision (allow, deny, fail_open, ...)."""
        assert self.gateway is not None
        with urllib.request.urlopen(self.gateway.admin_url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        decisions: collections.Counter[str] = collections.Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == self.decisions_metric:
                    decisions[sample.labels["decision"]] += int(sample.value)
        return decisions

    def event_loop(self) -> str:
        """The event loop the gateway reported in its startup line ("uvloop" or "asyncio")."""
        assert self.gateway is not None
        for line in self.gateway.stderr_lines:
            match = _EVENT_LOOP.search(line)
            if match:
                return match.group(1)
        return "unknown"


@dataclass(frozen=True)
class Variant:
    key: str  # the variant's letter, as the tables show it
    title: str
    start: Callable[[Environment], contextlib.AbstractContextManager[RunningVariant]]
    flood: bool = False  # sent as one client far over its limit (answered 429), not as 10,000 within theirs
    # The decision service measured (TRAEFIK_DECISIONS, RLS_DECISIONS), or None for a proxy;
    # a floor of one is asked the same questions, and so has it too.
    decides: str | None = None
    floor: str | None = None  # the key of the variant that is the least this one can cost


def gateway_yaml(upstream_url: str, *, store_url: str | None = None, limit: str | None = None, extra: str = "") -> str:
    """A gateway config with one route to the upstream, and at most one limit called `bench`;
    `extra`, more top-level keys as YAML lines."""
    store = f"store:\n  url: {store_url}\n" if store_url else ""
    limits = f"limits:\n  bench: {limit}\n" if limit else ""
    route_limits = "[bench]" if limit else "[]"
    return f"""listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
{extra}{store}{limits}routes:
  - match: {{path: /}}
    upstream: {upstream_url}
    limits: {route_limits}
"""


@contextlib.contextmanager
def running_gateway(config_text: str) -> Iterator[RunningVariant]:
    with started(GatewayProcess(config_text), "gateway") as gateway:
        yield RunningVariant(url=gateway.url, gateway=gateway)


@contextlib.contextmanager
def decision_listener(env: Environment) -> Iterator[RunningVariant]:
    """(b)'s gateway with a decision listener, asked by wrk as a trusted proxy on 127.0.0.1."""
    port = free_port()
    extra = f"decision_listen: 127.0.0.1:{port}\ntrusted_proxies: [127.0.0.1/32]\n"
    config = gateway_yaml(env.upstream_url, store_url=env.redis.url, limit=ALL_ALLOWED_LIMIT, extra=extra)
    with started(GatewayProcess(config), "gateway") as gateway:
        yield RunningVariant(url=f"http://127.0.0.1:{port}", gateway=gateway)


@contextlib.contextmanager
def rate_limit_service(env: Environment) -> Iterator[RunningVariant]:
    """A gateway serving Envoy's RLS on (b)'s Redis, its route without limits."""
    directory = env.work_dir / "rls-config"
    directory.mkdir(exist_ok=True)
    (directory / f"{RLS_DOMAIN}.yaml").write_text(RLS_CONFIG)
    port = free_port()
    extra = f"rls_listen: 127.0.0.1:{port}\nrls_config: {directory}\n"
    with started(GatewayProcess(gateway_yaml(env.upstream_url, store_url=env.redis.url, extra=extra)), "gateway") as gateway:
        yield RunningVariant(url=f"127.0.0.1:{port}", gateway=gateway, decisions_metric=RLS_DESCRIPTOR_DECISIONS)


@contextlib.contextmanager
def running_server(server: contextlib.AbstractContextManager) -> Iterator[RunningVariant]:
    with server as process:
        yield RunningVariant(url=process.url)


@contextlib.contextmanager
def running_grpc_server(server: ListeningProcess) -> Iterator[RunningVariant]:
    with server as process:
        yield RunningVariant(url=f"127.0.0.1:{process.port}")  # a gRPC target, as (j)'s


VARIANTS: tuple[Variant, ...] = (
    Variant("a", "gateway, no limits", lambda env: running_gateway(gateway_yaml(env.upstream_url))),
    Variant(
        "b", "gateway, Redis limit, 10,000 clients, all allowed",
        lambda env: running_gateway(gateway_yaml(env.upstream_url, store_url=env.redis.url, limit=ALL_ALLOWED_LIMIT)),
    ),
    # Beside (b), which it is but for the cost: what reading and settling the response adds.
    Variant(
        "k", "gateway, (b)'s Redis limit costed by the response (X-Usage-Units: 1, reserve 2), 10,000 clients, all allowed",
        lambda env: running_gateway(gateway_yaml(env.upstream_url, store_url=env.redis.url, limit=COSTED_LIMIT)),
    ),
    Variant(
        "c", "gateway, Redis limit, one client flooding (1/hour)",
        lambda env: running_gateway(gateway_yaml(env.upstream_url, store_url=env.redis.url, limit=FLOOD_LIMIT)),
        flood=True,
    ),
    Variant(
        "d", "gateway, in-process store, all allowed",
        lambda env: running_gateway(gateway_yaml(env.upstream_url, limit=ALL_ALLOWED_LIMIT)),
    ),
    Variant(
        "e", "nginx proxy_pass + limit_req, 1 worker",
        lambda env: running_server(nginx_limit_req_proxy(env.tools["nginx"], env.upstream_url)),
    ),
    Variant(
        "f", "naive aiohttp proxy (uvloop)",
        lambda env: running_server(naive_proxy(env.upstream_url, env.work_dir)),
    ),
    Variant(
        "f+redis", "naive aiohttp proxy + redis-py EVALSHA per request",
        lambda env: running_server(naive_proxy(env.upstream_url, env.work_dir, redis_url=env.redis.url)),
    ),
    Variant(
        "g", "the ceiling: aiohttp web.Server + 150-line httptools upstream client (uvloop)",
        lambda env: running_server(ceiling_proxy(env.upstream_url, env.work_dir)),
    ),
    # Sent the flood's requests, as (c) is, so that (c) ÷ (h) compares answers to the same request.
    Variant(
        "h", "the floor of a denial: aiohttp web.Server answering a fixed 429 (uvloop)",
        lambda env: running_server(denial_floor(env.work_dir)),
        flood=True,
    ),
    Variant(
        "i", "decision listener, Traefik forwardAuth at /decide/traefik, Redis limit, 10,000 clients, all allowed",
        decision_listener, decides=TRAEFIK_DECISIONS, floor="i-floor",
    ),
    # Asked (i)'s questions, so that (i) ÷ (i-floor) compares answers to the same request.
    Variant(
        "i-floor", "the floor of (i): aiohttp web.Server answering a prebuilt 200 with RateLimit fields (uvloop)",
        lambda env: running_server(decision_floor(env.work_dir)), decides=TRAEFIK_DECISIONS,
    ),
    Variant(
        "j", "Envoy RLS, gRPC ShouldRateLimit, Redis, 10,000 descriptor values, all allowed",
        rate_limit_service, decides=RLS_DECISIONS, floor="j-floor",
    ),
    # Asked by (j)'s client, so that (j) ÷ (j-floor) compares answers to the same calls.
    Variant(
        "j-floor", "the floor of (j): grpc.aio answering a prebuilt OK to every ShouldRateLimit (uvloop)",
        lambda env: running_grpc_server(rls_floor(env.work_dir)), decides=RLS_DECISIONS,
    ),
)
