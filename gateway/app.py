"""Assembles one gateway from its config: store, limiter, proxy handler, metrics, and the two aiohttp apps."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from gateway.admin import admin_app
from gateway.config import ConfigError, load_config
from gateway.config.model import GatewayConfig
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import StoreError, refusal
from gateway.limiter.store_factory import make_store
from gateway.metrics import UNMATCHED_ROUTE, Children, Metrics, breaker_gauge_setter
from gateway.proxy.handler import ProxyHandler
from gateway.proxy.protocol import PublicServer

log = logging.getLogger(__name__)

# What a reload cannot change in a running process: its sockets, processes, store
# connection and the admin listener's token. A changed one is named and waits for a restart.
RESTART_SETTINGS = (
    "listen", "admin_listen", "listen_tls", "workers", "store", "admin_token", "clients", "upstream_connections",
)


class Gateway:
    def __init__(self, config: GatewayConfig, *, multiprocess_metrics: bool = False) -> None:
        self.config = config
        self.metrics = Metrics(multiprocess=multiprocess_metrics)
        self.store = make_store(config.store)
        self.limiter = Limiter(
            self.store,
            local_divisor=config.store.local_divisor if config.store else 1,
            shared_store=config.store is not None,
            on_breaker_change=breaker_gauge_setter(self.metrics.store_breaker),
        )
        self.handler = ProxyHandler(config, self.limiter, self.metrics)
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
            log.error("config reload failed, the old config serves on: %s", exc)
            return False
        kept = [name for name in RESTART_SETTINGS if getattr(config, name) != getattr(self.config, name)]
        self.handler.reload(config)
        self._admin_api.update(config)
        self.config = config
        self.metrics.reload_success.set(time.time())
        log.info("config reloaded from %s: %d routes, %d limits", config.source, len(config.routes), len(config.limits))
        if kept:
            log.warning("changed settings that take effect only at restart: %s", ", ".join(kept))
        return True

    def public_server(self, **kwargs: Any) -> web.Server:
        """The public listener: aiohttp's low-level server, which hands every request to the
        proxy handler whatever its target (CONNECT's authority form, `*`), so each gets our
        answer and is counted. An Application would first run its router, which for an app
        without routes builds and discards a 404 and rebuilds the middleware chain on every
        request, costing more than the rest of the gateway's own work on it. `kwargs` go to
        aiohttp's RequestHandler: access_log, access_log_class. PublicServer answers what the
        parser refuses as problem+json and writes no Server banner, and holds each connection
        to `config.clients` (gateway.bounded_protocol).

        Request bodies are never inflated (`auto_decompress=False`): a gzip body is the
        upstream's to decode, and inflating it while its Content-Length went on unchanged
        cut or hung it there. It passes byte for byte, as responses do."""
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
        await self.store.close()
