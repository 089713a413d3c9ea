"""Request smuggling: a corpus of Content-Length / Transfer-Encoding
permutations sent over raw sockets, with an upstream that counts every request it
receives. The gateway and the upstream must agree on how many requests there were:
each upstream answer the client got is exactly one request the upstream saw, and
no probe whose framing two parsers could read two ways ever reaches the upstream.

The permutations are generated here, in the spirit of defparam's smuggler gadgets
(which the parser refused all ~1,400 of when probed from outside): CL+TE in both
orders, obfuscated Transfer-Encoding names and values, duplicate and malformed
Content-Length, bare LF and CR, obs-fold, NUL and vertical tab. Each probe is
followed by a complete second request (a smuggling attempt) and a final request
with `Connection: close`, so every reading of the bytes ends in a closed
connection and no probe waits for a timeout."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
from aiohttp import web
from yarl import URL

from gateway.testing import running_gateway
from tests.upstream import RecordingUpstream, serving

PROBE_TIMEOUT = 10.0
CONCURRENCY = 16
CHUNKED_BODY = "1\r\nZ\r\n0\r\n\r\n"

# (line, obfuscated): obfuscated lines are ones two parsers may read differently.
TE_LINES: list[tuple[str | None, bool]] = [
    (None, False),
    ("Transfer-Encoding: chunked", False),
    ("Transfer-Encoding: CHUNKED", False),
    ("Transfer-Encoding:\tchunked", False),
    ("Transfer-Encoding: chunked ", False),
    ("Transfer-Encoding : chunked", True),
    ("Transfer-Encoding: xchunked", True),
    ("Transfer-Encoding: chunk", True),
    ("Transfer-Encoding: chunked;", True),
    ('Transfer-Encoding: "chunked"', True),
    ("Transfer-Encoding: chunked, identity", True),
    # llhttp reads chunked as the final coding, as RFC 9112 §6.1 asks, and the gateway
    # re-frames the body it read: the upstream sees the same one request.
    ("Transfer-Encoding: identity, chunked", False),
    ("Transfer-Encoding: chunked, chunked", True),
    ("Transfer-Encoding: \x0bchunked", True),
    ("Transfer-Encoding: chunked\x00", True),
    ("Transfer-Encoding\x00: chunked", True),
    # Another header to HTTP: it frames nothing and is forwarded as sent.
    ("Transfer_Encoding: chunked", False),
    ("Transfer-Encoding: chunked\r\nTransfer-Encoding: identity", True),
    ("Transfer-Encoding: identity\r\nTransfer-Encoding: chunked", True),
    ("X-Pad: x\r\n Transfer-Encoding: chunked", True),  # obs-fold
    ("X-Pad: x\r\n\tTransfer-Encoding: chunked", True),  # obs-fold with a tab
    ("Transfer-Encoding:\r\n chunked", True),  # the value folded onto the next line
    ("Transfer-Encoding: chunked\nX-Pad: x", True),  # bare LF
    ("Transfer-Encoding: chunked\rX-Pad: x", True),  # bare CR
    ("X-Pad: x\nTransfer-Encoding: chunked", True),  # bare LF before
]
CL_LINES: list[tuple[str | None, bool]] = [
    (None, False),
    ("Content-Length: {n}", False),
    ("Content-Length:  {n}", False),
    ("Content-Length: 0", False),
    ("Content-Length: +{n}", True),
    ("Content-Length: -1", True),
    ("Content-Length: 0x{n}", True),
    ("Content-Length: {n}, {n}", True),
    ("Content-Length: {n}\r\nContent-Length: {n}", True),
    ("Content-Length: {n}\r\nContent-Length: 0", True),
    ("Content-Length: {n}\x00", True),
    ("Content-Length : {n}", True),
    ("Content-Length: {n}\nX-Pad: x", True),
    (" Content-Length: {n}", True),
    ("Content-Length: \x0b{n}", True),
]
REQUEST_LINE_ENDINGS = ("\r\n", "\n")


@dataclass(frozen=True)
class Probe:
    index: int
    data: bytes
    ambiguous: bool  # framing two parsers may read differently: must get 400 and reach nobody
    description: str


def probes() -> list[Probe]:
    out: list[Probe] = []
    combos = itertools.product(TE_LINES, CL_LINES, (False, True), REQUEST_LINE_ENDINGS)
    for (te, te_odd), (cl, cl_odd), cl_first, ending in combos:
        if (te is None or cl is None) and cl_first:
            continue  # the order matters only when both are there
        i = len(out)
        smuggled = f"GET /smuggled/{i} HTTP/1.1\r\nHost: gw\r\n\r\n"
        final = f"GET /final/{i} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
        # Content-Length covers part of the chunked body, all of it, or the smuggled request
        # too; never more than is sent, so no reading waits for bytes that never come.
        n = (4, len(CHUNKED_BODY), len(CHUNKED_BODY + smuggled))[i % 3]
        lines = [line.format(n=n) for line in ((cl, te) if cl_first else (te, cl)) if line is not None]
        head = f"POST /probe/{i} HTTP/1.1{ending}Host: gw\r\n" + "".join(line + "\r\n" for line in lines)
        data = (head + "\r\n" + CHUNKED_BODY + smuggled + final).encode("latin-1")
        both = te is not None and "Transfer-Encoding" in te and cl is not None
        ambiguous = te_odd or cl_odd or ending != "\r\n" or both
        out.append(Probe(i, data, ambiguous, repr(lines) + (" bare-LF request line" if ending == "\n" else "")))
    return out


@dataclass
class Answer:
    status: int
    from_upstream: bool


def parse_responses(data: bytes) -> list[Answer]:
    """Every response in the bytes the gateway sent back, in order."""
    answers: list[Answer] = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            raise AssertionError(f"a truncated response: {data[:200]!r}")
        lines = head.decode("latin-1").split("\r\n")
        headers = {n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines[1:])}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                rest = rest[size + 2 :]
                if size == 0:
                    break
        else:
            rest = rest[int(headers.get("content-length", "0")) :]
        answers.append(Answer(status=int(lines[0].split()[1]), from_upstream=headers.get("x-counted") == "1"))
        data = rest
    return answers


async def send(url: str, probe: Probe) -> list[Answer]:
    target = URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(probe.data)
        data = await asyncio.wait_for(reader.read(), PROBE_TIMEOUT)
    finally:
        writer.close()
        await writer.wait_closed()
    return parse_responses(data)


async def counted(request: web.BaseRequest) -> web.Response:
    await request.read()
    return web.Response(text="ok", headers={"X-Counted": "1"})


@pytest.fixture
async def counting_upstream():
    """An aiohttp upstream that records the path of every request it answers, once its body was read."""
    recording = RecordingUpstream(counted, once_answered=True)
    async with serving(recording.handle) as url:
        yield url, recording.paths


async def test_the_upstream_counts_exactly_the_requests_the_gateway_accepted(counting_upstream):
    upstream, seen = counting_upstream
    corpus = probes()
    assert len(corpus) > 1000
    config = f"routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"
    async with running_gateway(config) as gw:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(probe: Probe) -> list[Answer]:
            async with gate:
                return await send(gw.url, probe)

        results = await asyncio.gather(*(one(p) for p in corpus))
    hits = Counter(path.rsplit("/", 1)[1] for path in seen)
    mismatched = [
        (p.description, [a.status for a in answers], hits[str(p.index)])
        for p, answers in zip(corpus, results)
        if sum(a.from_upstream for a in answers) != hits[str(p.index)]
    ]
    assert not mismatched, mismatched[:10]
    assert len(seen) == sum(a.from_upstream for answers in results for a in answers)
    passed = [
        (p.description, [a.status for a in answers])
        for p, answers in zip(corpus, results)
        if p.ambiguous and (not answers or answers[0].status != 400 or hits[str(p.index)])
    ]
    assert not passed, f"{len(passed)} ambiguous probes were not refused: {passed[:10]}"
    # Every ambiguous probe ends at its 400: the connection closes, nothing behind it is read.
    assert all(len(answers) == 1 for p, answers in zip(corpus, results) if p.ambiguous)
    # The plain ones show the corpus can pass at all. Some of them are refused too: when the
    # bytes after a well-framed request are garbage, llhttp refuses them in the same read, and
    # aiohttp answers only the 400, forwarding nothing.
    plain = [answers for p, answers in zip(corpus, results) if not p.ambiguous]
    assert sum(any(a.from_upstream for a in answers) for answers in plain) >= len(plain) // 2
