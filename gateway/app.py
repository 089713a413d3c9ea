"""Assembles one gateway from its config: store, limiter, proxy handler, metrics, and the two aiohttp apps."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from gateway.admin import admin_app
from gateway.config.model import GatewayConfig
from gateway.limiter.limiter import Limiter
from gateway.limiter.store import StoreError
from gateway.limiter.store_factory import make_store
from gateway.metrics import UNMATCHED_ROUTE, Children, Metrics, breaker_gauge_setter
from gateway.proxy.handler import ProxyHandler
from gateway.proxy.protocol import PublicServer

log = logging.getLogger(__name__)


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
        self.admin_app = admin_app(config, self.limiter, self.metrics)

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
            # Not fatal: each check retries, and each limit's failure policy covers the gap.
            log.warning("store not reachable at start, failure policies apply until it is: %s", exc)
        await self.handler.start()

    async def close(self) -> None:
        await self.handler.close()
        await self.store.close()
