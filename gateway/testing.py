"""Helpers for testing against a real gateway: `running_gateway` starts one in
the current event loop, on free ports, and always shuts it down.

    async with running_gateway(config) as gw:
        async with aiohttp.ClientSession() as client:
            await client.get(gw.url + "/api/things")

With no store configured it runs on the in-process store, so a test suite
needs no Redis.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from gateway.app import Gateway
from gateway.config import GatewayConfig, parse_config
from gateway.config.units import Address
from gateway.server import PublicSite


@dataclass(frozen=True)
class RunningGateway:
    gateway: Gateway
    url: str
    admin_url: str


def config_from_yaml(text: str, *, environ: dict[str, str] | None = None) -> GatewayConfig:
    return parse_config(text, source="<test>", environ=environ or {})


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig | str) -> AsyncIterator[RunningGateway]:
    """Serve `config` (a GatewayConfig or YAML text) on 127.0.0.1 with free ports, the
    public one over TLS if it has `listen.tls` (`url` is then https://)."""
    if isinstance(config, str):
        config = config_from_yaml(config)
    config = dataclasses.replace(
        config, listen=Address(host="127.0.0.1", port=0), admin_listen=Address(host="127.0.0.1", port=0)
    )
    gateway = Gateway(config)
    await gateway.start()
    public = web.ServerRunner(gateway.public_server(access_log=None), shutdown_timeout=config.shutdown_grace)
    admin = web.AppRunner(gateway.admin_app, access_log=None)
    await public.setup()
    await admin.setup()
    try:
        await PublicSite(
            public, "127.0.0.1", 0, ssl_context=gateway.tls_context, handshake_timeout=config.clients.header_timeout
        ).start()
        await web.TCPSite(admin, "127.0.0.1", 0).start()
        yield RunningGateway(
            gateway=gateway,
            url=f"{'https' if gateway.tls_context else 'http'}://127.0.0.1:{public.addresses[0][1]}",
            admin_url=f"http://127.0.0.1:{admin.addresses[0][1]}",
        )
    finally:
        await public.cleanup()
        await admin.cleanup()
        await gateway.close()
