"""The load of the RLS variant (j): grpc.aio channels, each with a fixed number of
`ShouldRateLimit` calls in flight, for a given time, as Envoys with many requests in
flight would ask. Run as a process of its own, as wrk is, so that the benchmark's own
process takes no part; it prints one JSON line with what it counted.

    .venv/bin/python -m tests.bench.rls_clients HOST:PORT SECONDS CLIENTS CHANNELS IN_FLIGHT_PER_CHANNEL

Each call asks for one descriptor, `client` = one of CLIENTS values drawn at random, and
the requests are serialized once, before the clock starts, so the client spends its CPU
on gRPC alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import asdict, dataclass

import grpc

from gateway.envoy.generated import ratelimit_pb2, rls_pb2
from tests.bench.variants import RLS_DESCRIPTOR_KEY, RLS_DOMAIN

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
# As wrk's --timeout: a stalled call counts as slow, not failed.
CALL_TIMEOUT = 5.0
CONNECT_TIMEOUT = 10.0
OK = rls_pb2.RateLimitResponse.Code.OK


@dataclass
class Counts:
    calls: int = 0  # answered, OK or not
    not_ok: int = 0  # answered with overall_code other than OK
    errors: int = 0  # failed with a gRPC status
    seconds: float = 0.0


def serialized_requests(clients: int) -> list[bytes]:
    Descriptor = ratelimit_pb2.RateLimitDescriptor
    return [
        rls_pb2.RateLimitRequest(
            domain=RLS_DOMAIN,
            descriptors=[Descriptor(entries=[Descriptor.Entry(key=RLS_DESCRIPTOR_KEY, value=f"client-{i}")])],
        ).SerializeToString()
        for i in range(1, clients + 1)
    ]


async def load(target: str, seconds: float, clients: int, channel_count: int, in_flight: int) -> Counts:
    """`in_flight` calls on each of `channel_count` channels, for `seconds`."""
    requests = serialized_requests(clients)
    channels = [grpc.aio.insecure_channel(target) for _ in range(channel_count)]
    counts = Counts()
    try:
        await asyncio.wait_for(asyncio.gather(*(channel.channel_ready() for channel in channels)), CONNECT_TIMEOUT)
        # No request serializer: the pre-serialized bytes go out as they are.
        calls = [channel.unary_unary(METHOD, response_deserializer=rls_pb2.RateLimitResponse.FromString) for channel in channels]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds

        async def keep_asking(call: grpc.aio.UnaryUnaryMultiCallable) -> None:
            while loop.time() < deadline:
                try:
                    response = await call(random.choice(requests), timeout=CALL_TIMEOUT)
                except grpc.aio.AioRpcError:
                    counts.errors += 1
                    continue
                counts.calls += 1
                if response.overall_code != OK:
                    counts.not_ok += 1

        start = loop.time()
        await asyncio.gather(*(keep_asking(call) for call in calls for _ in range(in_flight)))
        counts.seconds = loop.time() - start
    finally:
        for channel in channels:
            await channel.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.rls_clients", description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("seconds", type=float)
    parser.add_argument("clients", type=int)
    parser.add_argument("channels", type=int)
    parser.add_argument("in_flight_per_channel", type=int)
    args = parser.parse_args(argv)
    try:
        counts = asyncio.run(load(args.target, args.seconds, args.clients, args.channels, args.in_flight_per_channel))
    except TimeoutError:
        print(f"no connection to {args.target} within {CONNECT_TIMEOUT:g} s", file=sys.stderr)
        return 1
    print(json.dumps(asdict(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
