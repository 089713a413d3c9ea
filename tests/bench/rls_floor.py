"""The floor of Envoy's rate-limit service (j): a grpc.aio server, on uvloop and with
the gateway's own server options, answering every `ShouldRateLimit` with one prebuilt
OK response, serialized once at startup in the shape and size of the gateway's answer
to (j)'s question (one descriptor's status with its limit, remaining and reset, and
the RateLimit fields to add). The request's bytes are not parsed: no descriptor
matching and no limiter, so what it measures is grpc.aio itself, the least a decision
of (j) can cost. It is asked by the same client as (j), tests/bench/rls_clients.py.

    python -m tests.bench.rls_floor --port 8085
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc
import uvloop

from gateway.envoy.bounds import grpc_options
from gateway.envoy.generated import rls_pb2
from gateway.envoy.service import SERVICE

Response = rls_pb2.RateLimitResponse
# What the gateway answers (j)'s all-allowed descriptor: one token of a million a second taken.
_NAME = '"rls.bench.client-9e2be32a"'
ANSWER = Response(
    overall_code=Response.Code.OK,
    statuses=[
        Response.DescriptorStatus(
            code=Response.Code.OK,
            current_limit=Response.RateLimit(requests_per_unit=1_000_000, unit=Response.RateLimit.Unit.SECOND),
            limit_remaining=999_999,
            duration_until_reset={"seconds": 1},
        )
    ],
    response_headers_to_add=[
        {"key": "RateLimit-Policy", "value": f"{_NAME};q=1000000;w=1"},
        {"key": "RateLimit", "value": f"{_NAME};r=999999;t=1"},
    ],
).SerializeToString()


async def should_rate_limit(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return ANSWER


async def serve(port: int) -> None:
    server = grpc.aio.server(options=grpc_options(reuse_port=False))
    # No (de)serializers: the request's bytes arrive as they are, and ANSWER leaves as it is.
    method = grpc.unary_unary_rpc_method_handler(should_rate_limit)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ShouldRateLimit": method}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()
