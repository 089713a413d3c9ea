"""The bounds of Envoy's rate-limit service: how big a request may be, and the gRPC server's
own limits on messages and concurrency. Pure: no I/O, no gRPC calls, so it is tested on its own.

A request's work (parsing, matching, one store script) grows with its descriptors and
entries, and all of it runs on the event loop the public listener shares. So a frame is
measured before protobuf parses it, and the parsed request against the caps below, each
set above what Envoy builds in practice. A request over a cap is refused whole, with a
one-line reason for INVALID_ARGUMENT: no part of it is checked or charged.

grpcio's own limits are set so that it never sheds an RPC with an error status: Envoy lets
those through unless its failure_mode_deny is set, which would bypass `on_store_error:
closed`. The gateway sheds instead, past `max_in_flight`, through the rules' failure
policies (gateway.envoy.service). docs/envoy-rls.md#bounds has the measurements.

Trusts nothing in the frame; the caps are the gateway's own.
"""

from __future__ import annotations

from typing import Any

# Envoy's default max_request_headers_kb is 60: no header value it accepts by default is longer.
MAX_VALUE_BYTES = 64 * 1024
# Envoy sends one descriptor per `rate_limits` entry that applies to the route: a handful.
MAX_DESCRIPTORS = 64
# One entry per action of a `rate_limits` entry; envoyproxy/ratelimit's configs nest 3 deep at most.
MAX_ENTRIES = 16
# Four of Envoy's largest header values; protobuf parses 256 KiB of tiny entries in about 1.4 ms.
MAX_MESSAGE_BYTES = 256 * 1024
# grpcio's default, made explicit: past it grpcio refuses the frame itself (RESOURCE_EXHAUSTED).
GRPC_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
# 8 times Envoy's default for a cluster (max_requests: 1024): grpcio resets streams past it.
MAX_STREAMS_PER_CONNECTION = 8192
# Past grpcio's defaults (1,000, then randomly; 3,000) it cancels calls, an error Envoy lets through.
MAX_PENDING_CALLS = 65536


def grpc_options(*, reuse_port: bool) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments. `reuse_port`: every worker binds the same port
    (grpcio's own default, which would otherwise let a second gateway share ours silently)."""
    return [
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_receive_message_length", GRPC_MAX_RECEIVE_BYTES),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ]


def frame_fault(size: int) -> str | None:
    """Why a frame of `size` bytes is refused unparsed, or None."""
    if size > MAX_MESSAGE_BYTES:
        return f"request of {size} bytes is over the {MAX_MESSAGE_BYTES}-byte limit"
    return None


def request_fault(request: Any, size: int) -> str | None:
    """Why a parsed RateLimitRequest, from a frame of `size` bytes, is over a cap, or None.
    Stops at the first fault found."""
    descriptors = request.descriptors
    if len(descriptors) > MAX_DESCRIPTORS:
        return f"{len(descriptors)} descriptors is over the limit of {MAX_DESCRIPTORS}"
    for i, descriptor in enumerate(descriptors):
        if len(descriptor.entries) > MAX_ENTRIES:
            return f"descriptors[{i}] has {len(descriptor.entries)} entries, over the limit of {MAX_ENTRIES}"
    if size <= MAX_VALUE_BYTES:  # no string in the frame is longer than the frame
        return None
    if _too_long(request.domain):
        return f"domain is over the {MAX_VALUE_BYTES}-byte limit"
    for i, descriptor in enumerate(descriptors):
        for j, entry in enumerate(descriptor.entries):
            if _too_long(entry.key) or _too_long(entry.value):
                return f"descriptors[{i}].entries[{j}]: a key or value is over the {MAX_VALUE_BYTES}-byte limit"
    return None


def _too_long(text: str) -> bool:
    # An ASCII string's length is its UTF-8 size, and Python knows it is ASCII at no cost.
    if len(text) <= MAX_VALUE_BYTES // 4:
        return False
    return (len(text) if text.isascii() else len(text.encode())) > MAX_VALUE_BYTES
