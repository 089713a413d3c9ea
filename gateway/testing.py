"""Helpers for testing against a real gateway: `running_gateway` starts one in
the current event loop, on free ports, and always shuts it down.

    async with running_gateway(config) as gw:
        async with aiohttp.ClientSession() as client:
            await client.get(gw.url + "/api/things")

With no store configured it runs on the in-process store, so a test suite
needs no Redis. The listeners are opened and drained by gateway.listeners, as
`gateway run` opens them; signals, workers and the access log's writer are left
out. Trusts the config it is given, as `gateway run` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.app import Gateway
from gateway.config import GatewayConfig, parse_config
from gateway.config.units import Address
from gateway.listeners import open_listeners


@dataclass(frozen=True)
class RunningGateway:
    gateway: Gateway
    url: str
    admin_url: str
    decision_url: str | None = None  # with `decision_listen` in the config


def config_from_yaml(text: str, *, environ: dict[str, str] | None = None) -> GatewayConfig:
    return parse_config(text, source="<test>", environ=environ or {})


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig | str) -> AsyncIterator[RunningGateway]:
    """Serve `config` (a GatewayConfig or YAML text) on 127.0.0.1 with free ports, the
    public one over TLS if it has `listen.tls` (`url` is then https://)."""
    if isinstance(config, str):
        config = config_from_yaml(config)
    config = dataclasses.replace(
        config,
        listen=Address(host="127.0.0.1", port=0),
        admin_listen=Address(host="127.0.0.1", port=0),
        decision_listen=None if config.decision_listen is None else Address(host="127.0.0.1", port=0),
    )
    gateway = Gateway(config)
    await gateway.start()
    try:
        async with open_listeners(gateway) as listeners:
            yield RunningGateway(
                gateway=gateway,
                url=f"{'https' if gateway.tls_context else 'http'}://127.0.0.1:{listeners.public.addresses[0][1]}",
                admin_url=f"http://127.0.0.1:{listeners.admin.addresses[0][1]}",
                decision_url=(
                    f"http://127.0.0.1:{listeners.decision.addresses[0][1]}" if listeners.decision is not None else None
                ),
            )
            # As `gateway run` stops: what is in flight gets up to the grace to finish.
            await listeners.drain(gateway.config.shutdown_grace)
    finally:
        await gateway.close()
