"""Variant (f): the proxy anyone would write in an afternoon, as the baseline the
gateway must beat. aiohttp on uvloop, one shared client session, the whole body
read and re-sent; with --redis, one redis-py EVALSHA of the project's
lua/token_bucket.lua per request, with a limit that allows everything.

    python -m tests.bench.naive_proxy --port 8081 --upstream http://127.0.0.1:9000 [--redis URL]
"""

from __future__ import annotations

import argparse

import aiohttp
import redis.asyncio as redis
import uvloop
from aiohttp import web

from gateway.redis.scripts import load_script

# Bucket capacity, refill per second and cost: far more than any client sends in a run.
ALL_ALLOWED_ARGS = ("b", "1000000.0", "1000000.0", "1.0", "0.0")


def build_app(upstream: str, redis_url: str | None) -> web.Application:
    app = web.Application()

    async def open_clients(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession()
        if redis_url:
            app["redis"] = redis.Redis.from_url(redis_url)
            app["sha"] = await app["redis"].script_load(load_script())

    async def close_clients(app: web.Application) -> None:
        await app["session"].close()
        if redis_url:
            await app["redis"].aclose()

    async def forward(request: web.Request) -> web.Response:
        if redis_url:
            key = "naive:" + request.headers.get("X-API-Key", request.remote or "")
            allowed, *_ = await app["redis"].evalsha(app["sha"], 1, key, *ALL_ALLOWED_ARGS)
            if not int(allowed):
                return web.Response(status=429)
        request_body = await request.read()
        async with app["session"].request(request.method, upstream + request.path_qs, data=request_body) as reply:
            body = await reply.read()
            return web.Response(status=reply.status, body=body, content_type=reply.content_type)

    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(open_clients)
    app.on_cleanup.append(close_clients)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--redis", help="redis:// URL; one EVALSHA per request when given")
    args = parser.parse_args()
    app = build_app(args.upstream.rstrip("/"), args.redis)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
