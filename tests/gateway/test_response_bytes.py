"""A relayed response's status line and header fields reach the client as the bytes the
upstream sent, obs-text (bytes 0x80-0xFF) included, as nginx and Envoy pass them; what
llhttp refuses in a header (a control byte, a byte outside a token in a name) is a 502,
and so is a control byte in the reason phrase, which llhttp lets through.

The upstreams are raw TCP servers writing exact bytes (`RawUpstream`), the gateway runs as
`running_gateway` starts it, and the client reads the answer's bytes off a raw socket.
The Location rule decides on the bytes that go out: a `\\xff` after the first `/` is
sent as it came, so no `//host` can be made of it."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.http import HttpVersion10, HttpVersion11
from multidict import CIMultiDict

from gateway.proxy.location import LocationRewrite
from gateway.proxy.relayed_response import field_bytes, serialized_head
from gateway.testing import running_gateway
from tests.gateway.test_upstream_client import RawUpstream
from tests.raw_client import RAW_TIMEOUT, raw_exchange, request_bytes


def routed_to(upstream: str) -> str:
    return f"routes:\n  - match: {{path: /}}\n    upstream: {upstream}\n"


def head_of(lines: list[tuple[str, str]]) -> list[bytes]:
    """raw_exchange's header lines (decoded as latin-1, so losslessly) as their bytes."""
    return [f"{name}: {value}".encode("latin-1") for name, value in lines]


async def relayed(answer: bytes) -> tuple[int, list[bytes], bytes]:
    """(status, header lines as bytes, body) of a GET through a gateway to an upstream
    answering `answer`, in which {origin} stands for the upstream's own http://host:port."""
    async with RawUpstream() as upstream:
        upstream.answers.append(answer.replace(b"{origin}", upstream.url.encode()))
        async with running_gateway(routed_to(upstream.url)) as gw:
            status, lines, body = await raw_exchange(gw.url, request_bytes("/x", []))
    return status, head_of(lines), body


def answer_with(*lines: bytes, status_line: bytes = b"HTTP/1.1 302 Found") -> bytes:
    return status_line + b"\r\n" + b"".join(line + b"\r\n" for line in lines) + b"Content-Length: 2\r\n\r\nok"


# --- the reproductions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "received"),
    [
        # The upstream's own address: rewritten to a path alone, the \xff kept after its first "/".
        (b"{origin}/\xff/evil.example/phish", b"/\xff/evil.example/phish"),
        (b"{origin}/\xff\xfe/evil.example/phish", b"/\xff\xfe/evil.example/phish"),
        # Relative: left alone, byte for byte.
        (b"/\xff/evil.example/phish", b"/\xff/evil.example/phish"),
        (b"/\xc3/evil.example/phish", b"/\xc3/evil.example/phish"),  # a UTF-8 lead byte alone
    ],
)
async def test_a_location_with_a_non_utf8_byte_never_becomes_another_host(sent, received):
    status, lines, _ = await relayed(answer_with(b"Location: " + sent, b"Content-Location: " + sent))
    assert status == 302
    assert b"Location: " + received in lines
    assert b"Content-Location: " + received in lines
    assert not any(line.startswith((b"Location: //", b"Content-Location: //")) for line in lines)


@pytest.mark.parametrize(
    "line",
    [
        b'Content-Disposition: attachment; filename="r\xe9sum\xe9.pdf"',  # Latin-1, as RFC 2616 servers send it
        b'Content-Disposition: attachment; filename="r\xc3\xa9sum\xc3\xa9.pdf"',  # UTF-8
        b"X-Name: M\xfcller \xff\xfe \x80",
        b"Set-Cookie: who=J\xf6rg; Path=/",
        b"Link: </caf\xe9>; rel=next",
        b"X-Mixed: caf\xc3\xa9 and caf\xe9\t(tab kept)",
        b"X-Overlong: \xc0\xaf\xe0\x80\xaf",  # no decoder may make "/" of these: they pass as they are
    ],
)
async def test_obs_text_in_a_header_arrives_byte_for_byte(line):
    status, lines, body = await relayed(answer_with(line, status_line=b"HTTP/1.1 200 OK"))
    assert status == 200
    assert line in lines
    # The fields the gateway and aiohttp write go out in the same head.
    assert b"Content-Length: 2" in lines and any(sent.startswith(b"X-Request-ID: ") for sent in lines)
    assert body == b"ok"


async def test_the_reason_phrase_arrives_byte_for_byte():
    async with RawUpstream(answer_with(status_line=b"HTTP/1.1 200 \xc7a va tr\xe8s bien")) as upstream:
        async with running_gateway(routed_to(upstream.url)) as gw:
            reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
            writer.write(request_bytes("/", []))
            answer = await asyncio.wait_for(reader.read(), RAW_TIMEOUT)
            writer.close()
    assert answer.startswith(b"HTTP/1.1 200 \xc7a va tr\xe8s bien\r\n")
    assert answer.endswith(b"\r\n\r\nok")


async def test_a_head_sent_before_its_body_arrived_is_exact_too():
    """The streamed path: the head leaves while the upstream still holds the body back."""
    release = asyncio.Event()

    async def head_then_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Disposition: inline; filename="\xe9t\xe9.txt"\r\nContent-Length: 4\r\n\r\n')
        await writer.drain()
        await release.wait()
        writer.write(b"done")
        await writer.drain()

    async with RawUpstream(head_then_body) as upstream:
        async with running_gateway(routed_to(upstream.url)) as gw:
            reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
            writer.write(request_bytes("/", []))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), RAW_TIMEOUT)
            release.set()
            body = await asyncio.wait_for(reader.read(), RAW_TIMEOUT)
            writer.close()
    assert b'\r\nContent-Disposition: inline; filename="\xe9t\xe9.txt"\r\n' in head
    assert body == b"done"


@pytest.mark.parametrize(
    "line",
    [b"X-Control: a\x01b", b"X-Delete: a\x7fb", b"X-Nul: a\x00b", b"X-Form-Feed: a\x0cb", b"X-N\xe9: name with obs-text"],
)
async def test_a_header_llhttp_refuses_is_a_502_and_none_of_it_is_sent(line):
    status, lines, _ = await relayed(answer_with(line, status_line=b"HTTP/1.1 200 OK"))
    assert status == 502
    name = line.partition(b":")[0]
    assert not any(sent.startswith(name + b":") for sent in lines)


@pytest.mark.parametrize("reason", [b"O\x01K", b"O\x7fK", b"O\x00K", b"O\x0bK"])
async def test_a_control_byte_in_the_reason_phrase_is_a_502(reason):
    """llhttp lets these through in a reason phrase, and nowhere else in a head."""
    status, lines, body = await relayed(answer_with(b"X-Upstream: yes", status_line=b"HTTP/1.1 200 " + reason))
    assert status == 502
    assert b"X-Upstream: yes" not in lines
    assert b"ok" not in body


# --- the head, and the Location rule, on their own ---------------------------------------------


def test_the_head_is_the_bytes_each_value_was_decoded_from():
    headers = CIMultiDict([("Location", "/\udcff/x"), ("X-Utf8", "café"), ("X-Twice", "1"), ("X-Twice", "2")])
    head = serialized_head(HttpVersion11, 302, "Trouv\xe9", headers)
    assert head == b"HTTP/1.1 302 Trouv\xe9\r\nLocation: /\xff/x\r\nX-Utf8: caf\xc3\xa9\r\nX-Twice: 1\r\nX-Twice: 2\r\n\r\n"
    assert serialized_head(HttpVersion10, 204, "", CIMultiDict()) == b"HTTP/1.0 204 \r\n\r\n"


def test_an_ascii_head_is_the_same_bytes_as_any_other():
    headers = CIMultiDict([("Location", "/x"), ("X-Twice", "1"), ("X-Twice", "2")])
    assert serialized_head(HttpVersion11, 302, "Found", headers) == b"HTTP/1.1 302 Found\r\nLocation: /x\r\nX-Twice: 1\r\nX-Twice: 2\r\n\r\n"


@pytest.mark.parametrize("value", ["a\r\nSet-Cookie: x=1", "a\nb", "a\rb", "a\x00b", "a\x7fb", "a\x1bb"])
@pytest.mark.parametrize("beside", ["ascii", "caf\udce9"])  # aiohttp's serializer, then our own
def test_the_head_refuses_a_control_character_rather_than_split_a_line(value, beside):
    with pytest.raises(ValueError, match="control character"):
        serialized_head(HttpVersion11, 200, "OK", CIMultiDict({"X-Beside": beside, "X-Injected": value}))
    with pytest.raises(ValueError, match="control character"):
        serialized_head(HttpVersion11, 200, value, CIMultiDict({"X-Beside": beside}))


@pytest.mark.parametrize(
    ("value", "rewritten"),
    [
        ("http://up:1/\udcff/evil.example/phish", b"/\xff/evil.example/phish"),
        ("http://up:1/\udcff\udcfe/x", b"/\xff\xfe/x"),
        ("http://up:1/é/x", b"/\xc3\xa9/x"),
        ("http://up:1//\udcffevil.example", b"/%2F\xffevil.example"),
        ("http://up:1/\\\udcff", b"/%5C\xff"),
    ],
)
def test_the_location_rule_reads_the_bytes_that_are_sent(value, rewritten):
    result = LocationRewrite.of(["http://up:1"], None).rewritten(value, "")
    assert result is not None
    assert field_bytes(result) == rewritten
    assert not field_bytes(result).startswith((b"//", b"/\\"))
