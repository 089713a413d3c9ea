"""Request bodies reach the upstream byte for byte, whatever their
Content-Encoding: the gateway is not the recipient of a gzip body and never
inflates it. Before, aiohttp's server inflated it while the original
Content-Length was forwarded: a 38-byte gzip body hung the upstream until the
read timeout (504 after 60 s), and a 63-byte gzip of 239 bytes arrived cut to
63 bytes of plain text. Responses pass unchanged too.

Raw sockets send the exact bytes; the echo upstream reports what it received."""

from __future__ import annotations

import gzip
import zlib

import pytest

from gateway.testing import running_gateway
from tests.raw_client import echoed, echoed_headers, raw_request

# A 38-byte gzip body: 18 bytes of text, compressed with no file name or time stamp.
SHORT_TEXT = b'{"hello": "world"}'
# 239 bytes that compress to 63: the body of the second reproduction.
LONG_TEXT = (b"abcdefghijklmnopqrstuvwxyz0123456789ABCD" + b"." * 239)[:239]
READ_TIMEOUT = "2s"  # the hang showed as a 504 after the read timeout; 2 s keeps it short


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def test_the_reproduction_bodies_have_the_sizes_of_the_issue():
    assert len(_gzip(SHORT_TEXT)) == 38
    assert (len(LONG_TEXT), len(_gzip(LONG_TEXT))) == (239, 63)


def _config(upstream: str) -> str:
    return f"""
routes:
  - match: {{path: /}}
    upstream: {upstream}
    timeout: {{read: {READ_TIMEOUT}}}
"""


def _post(body: bytes, encoding: str, *, chunked: bool = False) -> bytes:
    head = b"POST /echo HTTP/1.1\r\nHost: gateway.test\r\nContent-Type: application/json\r\n"
    head += b"Content-Encoding: " + encoding.encode() + b"\r\nConnection: close\r\n"
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("text", [SHORT_TEXT, LONG_TEXT], ids=["38-byte-gzip", "63-byte-gzip-of-239"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_gzip_request_body_reaches_the_upstream_byte_for_byte(upstream, text, chunked):
    body = _gzip(text)
    async with running_gateway(_config(upstream)) as gw:
        status, _, answer = await raw_request(gw.url, _post(body, "gzip", chunked=chunked))
    assert status == 200  # not a 504 after the read timeout
    echo = echoed(answer)
    assert echo["body"].encode("latin-1") == body
    assert echo["body_length"] == len(body)
    assert echoed_headers(echo, "Content-Encoding") == ["gzip"]


@pytest.mark.parametrize(
    "encoding, body",
    [("deflate", zlib.compress(LONG_TEXT)), ("br", b"\x1b\xee\x00\x00"), ("zstd", b"not really zstd"), ("x-custom", b"\x00\xff")],
)
async def test_request_bodies_in_any_content_encoding_pass_unchanged(upstream, encoding, body):
    """Even a body that does not decode as its encoding claims: decoding is the upstream's business."""
    async with running_gateway(_config(upstream)) as gw:
        status, _, answer = await raw_request(gw.url, _post(body, encoding))
    assert status == 200
    assert echoed(answer)["body"].encode("latin-1") == body


async def test_a_gzip_response_reaches_the_client_byte_for_byte(upstream):
    """The other direction, which already passed: the upstream's gzip bytes, its Content-Encoding and length."""
    async with running_gateway(_config(upstream)) as gw:
        status, headers, answer = await raw_request(
            gw.url, b"GET /gzip HTTP/1.1\r\nHost: gateway.test\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n"
        )
    from tests.upstream import GZIP_TEXT

    assert status == 200
    assert headers["content-encoding"] == ["gzip"]
    assert headers["content-length"] == [str(len(answer))]
    assert gzip.decompress(answer) == GZIP_TEXT
