"""`python -m tests.bench.usage_reader`: how fast the reader of a response's cost
(gateway.config.usage) reads bodies and streams of several shapes, in MB/s, on this
machine. Printed, not asserted: the suite never times anything."""

from __future__ import annotations

import json
import time

from tests.unit.test_usage_reader import JSON, OPENAI, SSE, _chunk, _throughput, read


def main() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}
    text = "All work and no play makes Jack a dull boy. " * 400_000
    shapes = {
        "a completion, one long string": {"choices": [{"message": {"content": text}}], "usage": usage},
        "embeddings, arrays of numbers": {"data": [{"embedding": [0.0123456] * 1536, "index": i} for i in range(1000)], "usage": usage},
        "many small objects": {"items": [{"id": i, "tags": ["a", "b"], "ok": True} for i in range(400_000)], "usage": usage},
    }
    for name, document in shapes.items():
        body = json.dumps(document).encode()
        print(f"\njson, {name}: {len(body) / 1e6:.0f} MB at {_throughput(JSON, body):.0f} MB/s")
    started = time.perf_counter()
    for _ in range(10_000):
        assert read(JSON, OPENAI) == 30
    print(f"\njson, the OpenAI body of {len(OPENAI)} bytes: {(time.perf_counter() - started) / 10_000 * 1e6:.1f} µs per response")
    stream = b"".join(_chunk(None, "word ") for _ in range(100_000)) + _chunk(usage, "") + b"data: [DONE]\n\n"
    print(f"sse-json, OpenAI chunks of {len(_chunk(None, 'word '))} bytes: {len(stream) / 1e6:.0f} MB at {_throughput(SSE, stream):.0f} MB/s")
    # Chunks as long as a held text gets, each with `"usage": null`: the 5 GiB stream's events.
    event = _chunk(None, 'a "usage": {"total_tokens": 1}\n' + "lorem ipsum dolor sit amet " * 580)
    stream = event * 2_000 + _chunk(usage, "") + b"data: [DONE]\n\n"
    print(f"sse-json, chunks of {len(event)} bytes: {len(stream) / 1e6:.0f} MB at {_throughput(SSE, stream):.0f} MB/s")


if __name__ == "__main__":
    main()
