"""`python -m tests.bench.paths`: what reading a request path costs per request.

Times gateway.proxy.paths.normalize_path on typical paths, in the default
setting, beside what the handler computed before the path rule existed (yarl's
decoded `request.path` of a fresh URL, then a dot/slash check). Best of 9 runs
of 100,000 calls each; one process, no I/O, so a few seconds in all.
"""

from __future__ import annotations

import time

from yarl import URL

from gateway.config.model import PathNormalization
from gateway.proxy.paths import normalize_path

PLAIN = ["/", "/api/reports", "/api/v1/users/12345/orders", "/static/app.v2.min.js", "/api/v1/users/12345/orders/98765/items/ab-12"]
SPECIAL = [
    "/.well-known/openid-configuration",
    "/api/users/john.doe%40example.com",
    "/api/projects/group%2Fproject/issues",
    "/api/caf%C3%A9/x",
    "/x/../api/reports",
    "/api;jsessionid=1/x",
]
CALLS = 100_000
RUNS = 9


def _best(run) -> float:
    """Nanoseconds per call, best of RUNS."""
    best = float("inf")
    for _ in range(RUNS):
        best = min(best, run())
    return best / CALLS * 1e9


def main() -> None:
    rule = PathNormalization()

    def rule_on(target: str):
        def run() -> float:
            started = time.perf_counter()
            for _ in range(CALLS):
                normalize_path(target.partition("?")[0], rule)
            return time.perf_counter() - started

        return run

    def before_on(path: str):
        def run() -> float:
            urls = [URL.build(path=path, query_string="page=2", encoded=True) for _ in range(CALLS)]
            started = time.perf_counter()
            for url in urls:
                decoded = url.path
                _ = decoded.startswith("/") and "//" not in decoded and "/." not in decoded
            return time.perf_counter() - started

        return run

    print("| path | path rule (ns) | before: yarl decode + check (ns) |")
    print("|---|---:|---:|")
    for path in PLAIN:
        print(f"| `{path}` | {_best(rule_on(path + '?page=2')):.0f} | {_best(before_on(path)):.0f} |")
    for path in SPECIAL:
        print(f"| `{path}` | {_best(rule_on(path + '?page=2')):.0f} | |")


if __name__ == "__main__":
    main()
