"""The `gateway` command: run, check, demo, and --version.

Every user error (a bad config, a port in use) ends as one line on stderr and
exit status 2, never a traceback. Ctrl-C before the server handles SIGINT (while
Python imports the gateway or reads the config) ends it quietly with status 130;
that is why this module imports only the standard library (and gateway.log_lines,
which needs no more) at the top. Once `run` or `demo` has set up the gateway's
log, that line goes after the log lines before it, through the same queue
(gateway.log_lines), which logging's shutdown writes at the exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, NoReturn

from gateway import __version__
from gateway.log_lines import stderr_handler, stderr_line

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.config.model import RlsConfig, RlsDescriptor, RlsRateLimit

EXIT_USAGE = 2
EXIT_INTERRUPTED = 128 + 2  # what a shell reports for a command SIGINT ended


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error, not usage text and a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = _ArgumentParser(prog="gateway", description="A rate-limiting HTTP API gateway.")
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="serve with the given config")
    run_parser.add_argument("-c", "--config", required=True, help="the YAML config file")
    run_parser.add_argument(
        "--access-log", nargs="?", const="text", choices=("text", "json"), help="log one line per request (text or json)"
    )
    run_parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    run_parser.add_argument("--watch", action="store_true", help="reload the config when its file changes (as SIGHUP does)")
    check_parser = commands.add_parser("check", help="validate the config and print what it means")
    check_parser.add_argument("-c", "--config", required=True, help="the YAML config file")
    demo_parser = commands.add_parser("demo", help="run a demo upstream and the gateway in front of it")
    demo_parser.add_argument(
        "-c", "--config", default=None, help="the gateway config (default: the demo config shipped in the package)"
    )
    demo_parser.add_argument(
        "--upstream", default="127.0.0.1:9000", help="where the demo upstream listens (sets DEMO_UPSTREAM for the config)"
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        # The demo configs name their upstream as ${DEMO_UPSTREAM}, so the route follows
        # the demo upstream wherever --upstream puts it.
        os.environ["DEMO_UPSTREAM"] = args.upstream
        if args.config is None:
            args.config = _demo_config()

    from gateway.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        # One line per mistake in the file, each as an error of its own.
        for line in exc.lines[:-1]:
            _fail(line)
        return _fail(exc.lines[-1])
    if args.command == "check":
        return _print(describe(config))
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[stderr_handler()],
    )
    if config.workers == 1:
        return _start(config, args)
    # Workers share their metrics through files in this directory. It must be set before
    # prometheus_client is imported, and fresh: files left by an earlier run would be counted too.
    metrics_dir = _fresh_metrics_dir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        return _start(config, args)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _demo_config() -> str:
    """The path of the demo config inside the installed package (gateway/demo_config.yaml),
    so `gateway demo` runs from any directory; a reload reads it again from there."""
    import importlib.resources

    return str(importlib.resources.files("gateway").joinpath("demo_config.yaml"))


def _fresh_metrics_dir() -> str:
    """A new directory for the workers' metrics files, named by this supervisor's pid. Those
    a killed supervisor left (SIGKILL, the OOM killer: no `finally` ran) are removed first:
    a directory whose pid is gone, or is ours (a container restarted with the same pid)."""
    temp = tempfile.gettempdir()
    for name in os.listdir(temp):
        prefix, _, rest = name.partition("gateway-metrics-")
        pid = rest.partition("-")[0]
        if prefix or not pid.isdigit():
            continue
        if int(pid) == os.getpid() or not _alive(int(pid)):
            shutil.rmtree(os.path.join(temp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"gateway-metrics-{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _start(config: GatewayConfig, args: argparse.Namespace) -> int:
    from gateway.server import StartupError, run

    try:
        if args.command == "demo":
            from gateway.demo import run_demo

            return run_demo(config, args.upstream)
        return run(config, access_log=args.access_log or config.access_log, watch=args.watch)
    except StartupError as exc:
        return _fail(str(exc))


def _print(text: str) -> int:
    """Print `text`; a reader that stopped early (`gateway check -c F | head -1`) is no error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would flush stdout again at exit and report the same broken pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _fail(message: str) -> int:
    stderr_line(f"gateway: {message}")
    return EXIT_USAGE


def describe(config: GatewayConfig) -> str:
    """What `gateway check` prints: the routes and limits as the gateway understood them."""
    from gateway.config.model import ResponseStyle
    from gateway.config.redaction import redacted_url
    from gateway.limiter.memory_store import ENTRY_BYTES
    from gateway.proxy.routing import shadowed

    held = f"{config.local_store_memory / 1024 / 1024:g} MiB, about {config.local_store_memory // ENTRY_BYTES:,} buckets"
    store = f"in-process (one process only), {held}"
    if config.store:
        store = f"{redacted_url(config.store.url)} timeout={config.store.timeout * 1000:g}ms prefix={config.store.prefix!r}"
        if config.store.local_divisor != 1:
            store += f" local_divisor={config.store.local_divisor}"
    trusted = ", ".join(str(network) for network in config.trusted_proxies) or "none (X-Forwarded-For is ignored)"
    paths = config.path_normalization
    lines = [
        f"{config.source}: OK",
        (
            f"listen {config.listen}{f' (TLS, {config.listen_tls.min_version} or newer)' if config.listen_tls else ''}, "
            f"admin {config.admin_listen}{' (bearer token)' if config.admin_token else ''}, workers {config.workers}, "
            f"max in flight {config.max_in_flight} per worker, shutdown grace {config.shutdown_grace:g}s, "
            f"listen backlog {config.listen_backlog}"
        ),
        f"store: {store}",
        f"trusted proxies: {trusted}",
        f"forwarded headers: {config.forwarded_headers.value}",
        (
            f"paths: dot_segments {paths.dot_segments.value}, escaped_slashes {paths.escaped_slashes.value}, "
            f"merge_slashes {str(paths.merge_slashes).lower()}"
        ),
    ]
    if config.decision_listen is not None:
        lines.append(f"decision listener {config.decision_listen}: /decide/nginx, /decide/traefik, /decide/envoy/<path>")
    if config.rls is not None:
        lines.extend(_rls_lines(config.rls))
    if config.jwt is not None:
        algorithms = ", ".join(sorted({key.algorithm for key in config.jwt.keys}))
        checks = "".join(
            f", {name} {value!r}" for name, value in (("issuer", config.jwt.issuer), ("audience", config.jwt.audience)) if value
        )
        lines.append(
            f"jwt: {algorithms} ({len(config.jwt.keys)} key{'s' if len(config.jwt.keys) != 1 else ''}){checks}, "
            f"leeway {config.jwt.leeway:g}s, on_invalid {config.jwt.on_invalid.value}"
        )
    lines.append("limits:")
    for limit in config.limits:
        if limit.quota is not None:
            reset = f"{int(limit.quota.reset // 3600):02d}:{int(limit.quota.reset % 3600 // 60):02d} UTC"
            shape = f"quota {limit.quota.limit} per {limit.quota.per} from {reset}"
        else:
            shape = f"rate {limit.rate.text} ({limit.rate.per_second:g}/s), burst {limit.burst:g}"
            if limit.max_delay:
                shape += f", delay up to {limit.max_delay:g}s"
        extras = f", lease {limit.lease} (lapse {limit.lease_lapse:g}s)" if limit.lease else ""
        if limit.cost is not None:
            extras += (
                f", cost from {limit.cost.source}: reserves {limit.cost.reserve} before forwarding, settles the "
                f"difference after the response (into debt when more), {limit.cost.missing} when the response does not say"
            )
        response = limit.response
        if response != ResponseStyle():
            body = f", body {response.content_type}" if response.body else ""
            extras += f", response {response.status} headers {response.headers.value}{body}"
        lines.append(
            f"  {limit.name}: {shape}, "
            f"key [{', '.join(str(k) for k in limit.key)}], on_store_error {limit.on_store_error.value}{extras}"
        )
        for tier in limit.tiers.limits.values() if limit.tiers else ():
            lines.append(f"    tier {tier.name}: rate {tier.rate.text} ({tier.rate.per_second:g}/s), burst {tier.burst:g}")
        if limit.allow is not None:
            lines.append(
                f"    allow: {len(limit.allow.networks)} network(s), {len(limit.allow.identities)} identit(ies), never limited"
            )
    for conc in config.concurrency_limits:
        lines.append(
            f"  {conc.name}: concurrency {conc.concurrency} in flight, lease_ttl {conc.lease_ttl:g}s, "
            f"key [{', '.join(str(k) for k in conc.key)}], on_store_error {conc.on_store_error.value}"
        )
    lines.append("routes (first match wins):")
    for i, route in enumerate(config.routes):
        listed = [f"{rl.limit.name} (cost {rl.cost})" for rl in route.limits]
        limits = ", ".join(listed + [f"{conc.name} (concurrency)" for conc in route.concurrency]) or "no limits"
        options = [name for name in ("strip_prefix", "preserve_host", "allow_path_parameters") if getattr(route, name)]
        if not route.match.case_sensitive:
            options.append("case-insensitive")
        for direction, rules in (("request", route.request_headers), ("response", route.response_headers)):
            changed = [f"set {n}" for n, _ in rules.set] + [f"add {n}" for n, _ in rules.add]
            changed += [f"remove {n}" for n in rules.remove]
            if changed:
                options.append(f"{direction} headers: {' '.join(changed)}")
        options.append(f"timeout connect {route.timeout.connect:g}s read {route.timeout.read:g}s")
        if route.timeout.total is not None:
            options.append(f"total {route.timeout.total:g}s")
        upstream = redacted_url(route.upstream) if isinstance(route.upstream, str) else route.upstream
        lines.append(f"  [{i}] {route.label} -> {upstream}: {limits}; {', '.join(options)}")
    for later, earlier in shadowed(config.routes):
        lines.append(
            f"warning: routes[{later}] ({config.routes[later].label}) is never reached: routes[{earlier}] "
            f"({config.routes[earlier].label}) comes first and matches every request it could"
        )
    return "\n".join(lines)


def _rls_lines(rls: RlsConfig) -> list[str]:
    """Envoy's rate-limit service: each domain's rate limits, by their descriptor's path."""
    lines = [f"envoy rate-limit service {rls.listen}: {len(rls.domains)} domain(s) from {rls.config_path}"]
    for domain, root in sorted(rls.domains.items()):
        lines.append(f"  domain {domain}:")
        lines.extend(f"    {path}: {rule}" for path, rule in _rls_rules(root, ()))
    return lines


def _rls_rules(node: RlsDescriptor, parents: tuple[str, ...], shared: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(path, rule) of each rate limit below `node`; `shared`: the share_threshold wildcards on the way."""
    rules = []
    for selector, child in node.children.items():
        path = (*parents, selector)
        sharing = (*shared, selector) if child.shared else shared
        if child.rate_limit is not None:
            rule = _rls_rule(child.rate_limit)
            if sharing:
                rule += f", one bucket for all values of {' and '.join(sharing)}"
            rules.append((" > ".join(path), rule))
        rules.extend(_rls_rules(child, path, sharing))
    return rules


def _rls_rule(rate_limit: RlsRateLimit) -> str:
    limit = rate_limit.limit
    if limit is None:
        return "unlimited"
    rule = f"{rate_limit.requests_per_unit}/{rate_limit.unit}, {'fixed window' if limit.quota else 'token bucket'}"
    if not rate_limit.requests_per_unit:
        rule += " (always over the limit)"
    rule += f", on_store_error {limit.on_store_error.value}"
    if limit.shadow and not rate_limit.quota_mode:
        rule += ", shadow mode"
    if rate_limit.charge_always:
        rule += ", charge always"
    if rate_limit.quota_mode:
        rule += ", quota mode"
    if rate_limit.name:
        rule += f", name {rate_limit.name}"
    if rate_limit.replaces:
        rule += f", replaces {', '.join(rate_limit.replaces)}"
    return rule
