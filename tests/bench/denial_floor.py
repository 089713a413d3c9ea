"""Variant (h), the floor of a denial: aiohttp's low-level `web.Server` answering
every request with one fixed 429, its body and headers built once at startup in
the shape and size of the gateway's own (RateLimit fields, Retry-After, a
problem+json body, a request id). No routing and no limiter: what a denial costs
on this HTTP server, the least the gateway's flood (c) can cost.

    python -m tests.bench.denial_floor --port 8083
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from tests.bench.low_level_server import Handler, serve

BODY = json.dumps(
    {
        "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
        "title": "Too Many Requests",
        "status": 429,
        "detail": "Rate limit 'bench' exceeded; retry in 3600 s.",
        "violated-policies": ["bench"],
    }
).encode()
HEADERS = CIMultiDictProxy(
    CIMultiDict(
        {
            "RateLimit-Policy": '"bench";q=1;w=3600',
            "RateLimit": '"bench";r=0;t=3600',
            "Retry-After": "3600",
            "Content-Type": "application/problem+json; charset=utf-8",
            # As long as the gateway's; the same for every answer, since only the size matters here.
            "X-Request-ID": "0" * 32,
        }
    )
)


def make_handler() -> Handler:
    async def deny(request: web.BaseRequest) -> web.Response:
        # A copy: aiohttp writes Content-Length, Date and Server into the response's headers.
        return web.Response(status=429, body=BODY, headers=CIMultiDict(HEADERS))

    return deny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(make_handler, args.port)


if __name__ == "__main__":
    main()
