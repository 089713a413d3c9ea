"""The `gateway` command: run, check, demo, and --version.

Every user error (a bad config, a port in use) ends as one line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from gateway import __version__
from gateway.config import ConfigError, GatewayConfig, load_config

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="A rate-limiting HTTP API gateway.")
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="serve with the given config")
    run_parser.add_argument("-c", "--config", required=True, help="the YAML config file")
    run_parser.add_argument(
        "--access-log", nargs="?", const="text", choices=("text", "json"), help="log one line per request (text or json)"
    )
    run_parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    check_parser = commands.add_parser("check", help="validate the config and print what it means")
    check_parser.add_argument("-c", "--config", required=True, help="the YAML config file")
    demo_parser = commands.add_parser("demo", help="run a demo upstream and the gateway in front of it")
    demo_parser.add_argument("-c", "--config", default="config/demo.yaml", help="the gateway config (default: %(default)s)")
    demo_parser.add_argument("--upstream", default="127.0.0.1:9000", help="where the demo upstream listens")
    args = parser.parse_args(argv)

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "check":
        print(describe(config))
        return 0
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command == "demo":
        from gateway.demo import run_demo

        return run_demo(config, args.upstream)
    if config.workers > 1:
        # Must be set before prometheus_client is imported, so all workers share their metrics.
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="gateway-metrics-"))
    from gateway.server import run

    return run(config, access_log=args.access_log)


def describe(config: GatewayConfig) -> str:
    """What `gateway check` prints: the routes and limits as the gateway understood them."""
    store = "in-process (one process only)"
    if config.store:
        from gateway.limiter.redis_store import redacted

        store = f"{redacted(config.store.url)} timeout={config.store.timeout * 1000:g}ms prefix={config.store.prefix!r}"
    lines = [
        f"{config.source}: OK",
        f"listen {config.listen}, admin {config.admin_listen}, workers {config.workers}",
        f"store: {store}",
        "limits:",
    ]
    for limit in config.limits:
        lines.append(
            f"  {limit.name}: rate {limit.rate.text} ({limit.rate.per_second:g}/s), burst {limit.burst:g}, "
            f"key [{', '.join(str(k) for k in limit.key)}], on_store_error {limit.on_store_error.value}"
        )
    lines.append("routes (first match wins):")
    for i, route in enumerate(config.routes):
        limits = ", ".join(f"{rl.limit.name} (cost {rl.cost})" for rl in route.limits) or "no limits"
        lines.append(f"  [{i}] {route.label} -> {route.upstream}: {limits}")
    return "\n".join(lines)
