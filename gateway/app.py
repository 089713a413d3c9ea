"""Assembles one gateway from its config: store, limiter, proxy handler, decision service, metrics, and the aiohttp servers.

Trusts the config, which `gateway.config.loader` has validated; a reload that does not
load keeps the config being served."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.admin import admin_app
from gateway.config import ConfigError, load_config, tls
from gateway.config.model import GatewayConfig
from gateway.decision.core import Decider
from gateway.limiter.limiter import Limiter
from gateway.limiter.memory_store import MemoryStore
from gateway.limiter.settlement import SETTLEMENT_OUTCOMES
from gateway.limiter.store import StoreError, refusal
from gateway.limiter.worker_resets import WorkerResets
from gateway.metrics import UNMATCHED_ROUTE, Children, Metrics, breaker_gauge_setter
from gateway.proxy.decision import DecisionService
from gateway.proxy.handler import ProxyHandler
from gateway.proxy.protocol import PublicServer
from gateway.stores import make_store

if TYPE_CHECKING:
    from gateway.envoy.service import RateLimitService

log = logging.getLogger(__name__)

# What a reload cannot change in a running process: its sockets, processes, store
# connection and the admin listener's token. A changed one is named, by the YAML key the
# user wrote rather than the model's attribute, and waits for a restart.
RESTART_SETTINGS: tuple[tuple[str, Callable[[GatewayConfig], object]], ...] = (
    ("listen", attrgetter("listen")),
    ("listen.backlog", attrgetter("listen_backlog")),
    # Its files and min_version reload into the live context; only turning TLS on or off waits.
    ("listen.tls", lambda config: config.listen_tls is not None),
    ("admin_listen", attrgetter("admin_listen")),
    ("decision_listen", attrgetter("decision_listen")),
    ("admin_token_env", attrgetter("admin_token")),
    ("admin_hosts", attrgetter("admin_hosts")),
    ("workers", attrgetter("workers")),
    ("store", attrgetter("store")),
    ("client_header_timeout", attrgetter("clients.header_timeout")),
    ("client_body_timeout", attrgetter("clients.body_timeout")),
    ("keepalive_timeout", attrgetter("clients.keepalive_timeout")),
    ("keepalive_requests", attrgetter("clients.keepalive_requests")),
    ("max_header_size", attrgetter("clients.max_header_size")),
    ("upstream_connections", attrgetter("upstream_connections")),
    ("upstream_max_header_size", attrgetter("upstream_max_header_size")),
    ("upstream_max_header_lines", attrgetter("upstream_max_header_lines")),
    ("access_log", attrgetter("access_log")),
    ("local_store_memory", attrgetter("local_store_memory")),
    ("rls_listen", lambda config: config.rls.listen if config.rls else None),
)


class Gateway:
    def __init__(
        self, config: GatewayConfig, *, multiprocess_metrics: bool = False, resets: WorkerResets | None = None
    ) -> None:
        """`resets`: with several workers, the log of bucket resets they share (gateway.server)."""
        self.config = config
        self.metrics = Metrics(multiprocess=multiprocess_metrics)
        evicted = self.metrics.local_store_evictions.inc
        self.store = make_store(config.store, local_memory=config.local_store_memory, on_evict=evicted)
        settled = Children(self.metrics.settlements, ("outcome",)).export(*((outcome,) for outcome in SETTLEMENT_OUTCOMES))
        self.limiter = Limiter(
            self.store,
            local_store=lambda **kw: MemoryStore(max_bytes=config.local_store_memory, on_evict=evicted, **kw),
            local_divisor=config.local_divisor,
            shared_store=config.store is not None,
            on_breaker_change=breaker_gauge_setter(self.metrics.store_breaker),
            on_lease_release_failed=self.metrics.lease_release_failures.inc,
            on_settlement=lambda outcome: settled(outcome).inc(),
            resets=resets,
        )
        self.decider = Decider(self.limiter, self.metrics.limiter_latency, self.metrics.delay)
        self.handler = ProxyHandler(config, self.decider, self.metrics)
        self.rls = _rls_service(config, self.decider, self.metrics)
        self.decisions = DecisionService(lambda: self.handler.plans, self.decider, self.metrics)  # served only with decision_listen
        # The public listener's, built here so that a reload can load renewed files into it.
        self.tls_context = tls.server_context(config.listen_tls) if config.listen_tls else None
        self.draining = False  # set when the drain starts: /readyz answers 503 from then on
        self.admin_app, self._admin_api = admin_app(config, self.limiter, self.metrics, draining=lambda: self.draining)

    def reload(self) -> bool:
        """Read the config file again and, only if it is valid throughout, serve it from the next
        request on. A bad file keeps the old config, logs one line and counts a failure.
        Buckets are named by limit name, in either store, so a limit keeps its buckets."""
        try:
            config = load_config(self.config.source)
        except ConfigError as exc:
            self.metrics.reload_failures.inc()
            # One log line however many mistakes the file has: each is one line already.
            log.error("config reload failed, the old config serves on: %s", "; ".join(exc.lines))
            return False
        kept = [key for key, setting in RESTART_SETTINGS if setting(config) != setting(self.config)]
        self.handler.reload(config)
        if self.rls is not None and config.rls is not None:
            self.rls.reload(config)
        self._admin_api.update(config)
        self._reload_tls(config)
        self.config = config
        self.metrics.reload_success.set(time.time())
        log.info(
            "config reloaded from %s: %d routes, %d limits",
            config.source, len(config.routes), len(config.limits) + len(config.concurrency_limits),
        )
        if kept:
            log.warning("changed settings that take effect only at restart: %s", ", ".join(kept))
        return True

    def _reload_tls(self, config: GatewayConfig) -> None:
        if self.tls_context is None or config.listen_tls is None:
            return
        try:
            tls.reload_context(self.tls_context, config.listen_tls)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError; EncryptedKey a ValueError
            # The loader read these files a moment ago: they changed since. The old pair serves on.
            log.error("listen.tls: cannot load the certificate and key, the old ones serve on: %s", exc)
            return
        log.info("listen.tls: %s loaded again, for new connections", config.listen_tls.cert_file)

    def public_server(self, **kwargs: Any) -> web.Server:
        """The public listener: aiohttp's low-level server, which hands every request to the
        proxy handler whatever its target (CONNECT's authority form, `*`), so each gets our
        answer and is counted. An Application would first run its router, which for an app
        without routes builds and discards a 404 and rebuilds the middleware chain on every
        request, costing more than the rest of the gateway's own work on it. `kwargs` go to
        aiohttp's RequestHandler: access_log, access_log_class. PublicServer answers what the
        parser refuses as problem+json and writes no Server banner, and holds each connection
        to `config.clients` (gateway.proxy.bounded_protocol).

        Request bodies are never inflated (`auto_decompress=False`): a gzip body is the
        upstream's to decode, and inflated under its original Content-Length it would arrive
        cut short or hang there. It passes byte for byte, as responses do."""
        # A request the parser refused has no method to trust: it is counted as OTHER, and
        # bound on first use like every other child, so /metrics shows it once it happens.
        refused = Children(self.metrics.requests, route=UNMATCHED_ROUTE, method="OTHER", status_class="4xx")
        return PublicServer(
            self.handler.handle,
            limits=self.config.clients,
            refused=lambda: refused().inc(),
            auto_decompress=False,
            **kwargs,
        )

    def decision_server(self) -> web.Server:
        """The decision listener (gateway.proxy.decision): the same low-level server and
        client limits as the public listener, every request to the decision handler. It
        writes no access log: the proxy asking logs the request it holds, and
        gateway_decision_requests_total counts the answers (aiohttp's default would log a
        line per decision at INFO)."""
        return PublicServer(self.decisions.handle, limits=self.config.clients, auto_decompress=False, access_log=None)

    @property
    def in_flight(self) -> int:
        """Requests and decisions being answered now: a drain waits for this to reach 0."""
        return self.handler.in_flight + self.decisions.in_flight

    async def start(self) -> None:
        try:
            await self.store.start()
        except StoreError as exc:
            if self.config.store is not None and self.config.store.required:
                raise
            # Not fatal: each check retries, and each limit's failure policy covers the gap.
            if refusal(str(exc)):
                log.error("store refuses the gateway, failure policies apply until it is fixed: %s", exc)
            else:
                log.warning("store not reachable at start, failure policies apply until it is: %s", exc)
        await self.handler.start()

    async def close(self) -> None:
        await self.handler.close()
        await self.limiter.settle()  # the last requests' refunds and releases, before the store goes
        await self.store.close()


def _rls_service(config: GatewayConfig, decider: Decider, metrics: Metrics) -> RateLimitService | None:
    """Envoy's rate-limit service on the same limiter, when the config has `rls_listen`;
    imported only then, since grpcio is an extra."""
    if config.rls is None:
        return None
    from gateway.envoy.service import RateLimitService

    return RateLimitService(config, decider, metrics.rls_descriptors)
