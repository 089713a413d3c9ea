"""The floor of the decision listener (i): aiohttp's low-level `web.Server` answering
every request with one prebuilt 200 carrying the RateLimit fields, in the shape and
size of the gateway's own allow (RateLimit-Policy and RateLimit, an empty body). It
is sent (i)'s requests, Traefik forwardAuth questions, and reads none of them: no
trust check, no routing, no limiter. What an answer costs on this HTTP server, the
least a decision of (i) can cost.

    python -m tests.bench.decision_floor --port 8084
"""

from __future__ import annotations

import argparse

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from tests.bench.low_level_server import Handler, serve

# The fields the gateway's decision listener sends with (i)'s allow, as it words them for
# the bench's all-allowed limit (one token taken of a million a second).
HEADERS = CIMultiDictProxy(
    CIMultiDict({"RateLimit-Policy": '"bench";q=1000000;w=1', "RateLimit": '"bench";r=999999;t=1'})
)


def make_handler() -> Handler:
    async def allow(request: web.BaseRequest) -> web.Response:
        # A copy: aiohttp writes Content-Length, Date and Server into the response's headers.
        return web.Response(status=200, headers=CIMultiDict(HEADERS))

    return allow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(make_handler, args.port)


if __name__ == "__main__":
    main()
