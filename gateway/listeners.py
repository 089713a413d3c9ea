"""Opening the gateway's listeners: the public one (the proxy, with the access log when
asked for), the admin one and, with `decision_listen`, the decision one (forward-auth
answers) and, with `rls_listen`, Envoy's rate-limit service, for a started `Gateway`, and
draining them.

`gateway run` (gateway.server) and the in-process gateway of the tests
(gateway.testing) both open them here, so the tests serve what production serves;
signals, workers and the process's logs stay in gateway.server. Trusts its caller for
the addresses: they come from the config, and a port that cannot be bound is a
StartupError naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.app import Gateway
from gateway.proxy.access_log import ACCESS_LOG_FORMATS, access_logger

if TYPE_CHECKING:
    from gateway.envoy.service import RlsServer  # grpcio is an extra: imported only when configured

# aiohttp's runner waits its shutdown_timeout for a handler, then cancels and waits it
# again, so given the grace it would hold the exit for twice the grace. The drain waits
# out the grace itself; then the cut takes at most 2 x this.
CUT_SECONDS = 0.1
DRAIN_POLL_SECONDS = 0.01  # a drain notices the last request within this


class StartupError(Exception):
    """The gateway could not start (an address that cannot be bound); str() is the one line shown."""


@dataclass(frozen=True)
class Listeners:
    gateway: Gateway
    public: web.ServerRunner
    admin: web.AppRunner
    decision: web.ServerRunner | None = None
    rls: RlsServer | None = None  # Envoy's rate-limit service, when configured

    @property
    def rls_port(self) -> int | None:
        return self.rls.port if self.rls is not None else None

    async def drain(self, grace: float) -> None:
        """Stop accepting on the public and decision listeners and Envoy's rate-limit service,
        then give the requests, questions and RPCs in flight up to `grace` to finish;
        /readyz answers 503 and /metrics and /healthz stay up meanwhile."""
        self.gateway.draining = True
        for runner in (self.public, self.decision):
            for site in list(runner.sites) if runner is not None else ():
                await site.stop()
        rls = asyncio.ensure_future(self.rls.stop(grace)) if self.rls is not None else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # Polled, not an event: the request path would otherwise pay to signal each request's end.
        while self.gateway.in_flight and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if rls is not None:
            await rls  # its RPCs are answered within a store timeout, well inside the grace


@contextlib.asynccontextmanager
async def open_listeners(
    gateway: Gateway, *, access_log: str | None = None, reuse_port: bool = False
) -> AsyncIterator[Listeners]:
    """Serve `gateway` on its config's `listen` (over TLS with `listen.tls`) and
    `admin_listen` (and `decision_listen` when set) until the block ends; then cut what is still in flight (drain first
    for a graceful stop). `access_log` ("text" or "json") writes a line per request to
    gateway.proxy.access_log's logger; `reuse_port` lets every worker bind the same ports."""
    config = gateway.config
    public = web.ServerRunner(
        gateway.public_server(
            access_log=access_logger if access_log else None,
            access_log_class=ACCESS_LOG_FORMATS[access_log or "text"],
        ),
        shutdown_timeout=CUT_SECONDS,
    )
    admin = web.AppRunner(gateway.admin_app, access_log=None, shutdown_timeout=CUT_SECONDS)
    decision = (
        web.ServerRunner(gateway.decision_server(), shutdown_timeout=CUT_SECONDS)
        if config.decision_listen is not None
        else None
    )
    await public.setup()
    await admin.setup()
    if decision is not None:
        await decision.setup()
    try:
        sites: list[web.BaseSite] = [
            PublicSite(
                public, config.listen.host, config.listen.port, reuse_port=reuse_port, ssl_context=gateway.tls_context,
                handshake_timeout=config.clients.header_timeout, backlog=config.listen_backlog,
            ),
            web.TCPSite(admin, config.admin_listen.host, config.admin_listen.port, reuse_port=reuse_port),
        ]
        addresses = [config.listen, config.admin_listen]
        if decision is not None and config.decision_listen is not None:
            # Plain HTTP: the proxies asking sit beside the gateway, as its admin listener's readers do.
            sites.append(web.TCPSite(
                decision, config.decision_listen.host, config.decision_listen.port, reuse_port=reuse_port,
                backlog=config.listen_backlog,
            ))
            addresses.append(config.decision_listen)
        for site, address in zip(sites, addresses):
            try:
                await site.start()
            except OSError as exc:
                raise StartupError(f"cannot listen on {address}: {os_reason(exc)}") from None
        async with contextlib.AsyncExitStack() as stack:
            rls = None
            if gateway.rls is not None and config.rls is not None:
                from gateway.envoy.service import serving  # grpcio is an extra: only when configured

                address = config.rls.listen
                try:
                    rls = await stack.enter_async_context(
                        serving(
                            gateway.rls, address.host, address.port, reuse_port=reuse_port,
                            max_in_flight=lambda: gateway.config.max_in_flight, on_shed=gateway.metrics.rls_shed.inc,
                        )
                    )
                except OSError as exc:
                    raise StartupError(f"cannot listen on {address} (rls_listen): {os_reason(exc)}") from None
            yield Listeners(gateway, public, admin, decision, rls)
    finally:
        # What is still in flight now is cut: aiohttp waits CUT_SECONDS twice for it.
        await public.cleanup()
        await admin.cleanup()
        if decision is not None:
            await decision.cleanup()


class PublicSite(web.TCPSite):
    """aiohttp's TCPSite, but a TLS handshake must finish within `handshake_timeout`
    (client_header_timeout), as nginx bounds it, not asyncio's default 60 s: until the
    handshake is done the connection has no protocol, so bounded_protocol's head timer has
    not started, and a client that sends half a ClientHello would hold its socket that long.
    TCPSite passes no ssl_handshake_timeout, so start() is its own, with the same fields."""

    __slots__ = ("_handshake_timeout",)

    def __init__(self, *args: Any, handshake_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handshake_timeout = handshake_timeout

    async def start(self) -> None:
        if self._ssl_context is None:
            await super().start()
            return
        await web.BaseSite.start(self)
        assert self._runner.server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._runner.server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


def os_reason(exc: OSError) -> str:
    """'Address already in use': uvloop's errors carry errno but no strerror."""
    return os.strerror(exc.errno) if exc.errno else str(exc)
