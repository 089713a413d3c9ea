"""Config documents that several test modules check."""

# The reference example, exactly as first written: config/gateway.yaml's first limits and route began so.
import itertools

ISSUE_EXAMPLE = """\
listen: 0.0.0.0:8080
admin_listen: 127.0.0.1:9090
workers: 1
store:
  url: redis://127.0.0.1:6379/0
  timeout: 10ms
  prefix: "rl:"
trusted_proxies: [10.0.0.0/8]
limits:
  per_client: {rate: 100/minute, burst: 20, key: [header:X-API-Key, ip], on_store_error: open}
  reports: {rate: 1/second, burst: 5, key: [header:X-API-Key], on_store_error: closed}
routes:
  - match: {path: /api/reports, methods: [POST]}
    upstream: http://127.0.0.1:9000
    limits: [per_client, {name: reports, cost: 2}]
  - match: {path: /}
    upstream: http://127.0.0.1:9000
    limits: [per_client]
"""

# One Redis limit on every request, keyed by X-API-Key and failing open: the
# settings under which a check not answered in time would let a request through.
ONE_REDIS_LIMIT = """
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store:
  url: {url}
limits:
  {name}:
    rate: {rate}
    burst: {burst}
    key: header:X-API-Key
    on_store_error: open
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [{name}]
"""


def alias_bomb(levels: int) -> str:
    """A "billion laughs" config: each level is a list of nine aliases of the one before,
    so the file is a few hundred bytes and `routes` expands to 9**levels strings."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    names = "abcdefghijk"[: levels]
    for previous, name in itertools.pairwise(names):
        lines.append(f"{name}: &{name} [{','.join([f'*{previous}'] * 9)}]")
    return "\n".join(lines) + f"\nroutes: [*{names[-1]}]\n"


# 267 and 302 bytes. A loader that expands aliases while walking the tree takes seconds and
# hundreds of MB on the first (9**7 values), minutes on the second, before any key is checked.
ALIAS_BOMBS = {"seven levels": alias_bomb(7), "eight levels": alias_bomb(8)}
