"""The request head's constant part, built once per upstream (`Endpoint`): the version and
Host line after the request target, and the Authorization line of the URL's credentials.

What the tests prove:
- the Endpoint holds those lines as they go on the wire, for default and other ports,
  IPv6 literals, base paths and credentials (percent-encoded ones decoded);
- on the wire, every combination of the URL's credentials, a client's Authorization
  (in any case), a kept client Host and header names in any case gives exactly the head
  the client wrote before those lines were built once: the request line, Host, the
  client's lines in order and as spelt but its Authorization when the URL has
  credentials, then the URL's Authorization, then the framing.

The upstream is a raw asyncio server on a free port that records the bytes it reads."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator

import pytest
from multidict import CIMultiDict

from gateway.upstream.client import Endpoint, UpstreamClient

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CREDENTIALS = base64.b64encode(b"alice:s:cret").decode()


@contextlib.asynccontextmanager
async def raw_upstream() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A server on a free port that reads each request's head (the tests send no body),
    records it and answers 200 "ok"; yields its port and the heads."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.closing(writer):
            with contextlib.suppress(asyncio.IncompleteReadError):
                while True:
                    heads.append(await reader.readuntil(b"\r\n\r\n"))
                    writer.write(OK)
                    await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], heads


ENDPOINTS = {
    "default port": ("http://example.com:80/", " HTTP/1.1\r\nHost: example.com\r\n", "", ""),
    "https default port": ("https://example.com", " HTTP/1.1\r\nHost: example.com\r\n", "", ""),
    "another port and a base path": ("https://example.com:8443/api/v1/", " HTTP/1.1\r\nHost: example.com:8443\r\n", "/api/v1", ""),
    "IPv6": ("http://[::1]:8080", " HTTP/1.1\r\nHost: [::1]:8080\r\n", "", ""),
    "credentials": (
        "http://alice:s%3Acret@10.0.0.5:9000/base",
        " HTTP/1.1\r\nHost: 10.0.0.5:9000\r\n",
        "/base",
        f"Authorization: Basic {CREDENTIALS}\r\n",
    ),
    "a user without a password": ("http://bob@host", " HTTP/1.1\r\nHost: host\r\n", "", "Authorization: Basic Ym9iOg==\r\n"),
}


@pytest.mark.parametrize("url, after_target, base_path, authorization_line", ENDPOINTS.values(), ids=ENDPOINTS.keys())
def test_the_endpoint_holds_the_heads_constant_lines(url: str, after_target: str, base_path: str, authorization_line: str) -> None:
    endpoint = Endpoint.of(url, None)
    assert (endpoint.after_target, endpoint.base_path, endpoint.authorization_line) == (after_target, base_path, authorization_line)


# (URL credentials, request headers, kept Host) -> the head's lines after the request line's target.
HEADS = {
    "no credentials": (
        "", [("Accept", "*/*"), ("x-lower", "1"), ("Authorization", "Bearer c")], None,
        b"Host: {authority}\r\nAccept: */*\r\nx-lower: 1\r\nAuthorization: Bearer c\r\n\r\n",
    ),
    "no credentials, the client's Host kept": (
        "", [("X-One", "1")], "api.example.com",
        b"Host: api.example.com\r\nX-One: 1\r\n\r\n",
    ),
    "credentials, no client Authorization": (
        "alice:s%3Acret@", [("x-lower", "1"), ("X-Upper", "2")], None,
        b"Host: {authority}\r\nx-lower: 1\r\nX-Upper: 2\r\nAuthorization: Basic {credentials}\r\n\r\n",
    ),
    "credentials replace the client's, in any case": (
        "alice:s%3Acret@", [("authorization", "Bearer a"), ("X-One", "1"), ("AUTHORIZATION", "Bearer b"), ("Authorization", "Bearer c")], None,
        b"Host: {authority}\r\nX-One: 1\r\nAuthorization: Basic {credentials}\r\n\r\n",
    ),
    "credentials and the client's Host kept": (
        "alice:s%3Acret@", [("Authorization", "Bearer c"), ("accept", "*/*")], "api.example.com",
        b"Host: api.example.com\r\naccept: */*\r\nAuthorization: Basic {credentials}\r\n\r\n",
    ),
    "credentials, no header lines": ("alice:s%3Acret@", [], None, b"Host: {authority}\r\nAuthorization: Basic {credentials}\r\n\r\n"),
}


@pytest.mark.parametrize("userinfo, headers, host, expected", HEADS.values(), ids=HEADS.keys())
async def test_the_head_on_the_wire(userinfo: str, headers: list[tuple[str, str]], host: str | None, expected: bytes) -> None:
    async with raw_upstream() as (port, heads):
        authority = f"127.0.0.1:{port}"
        with contextlib.closing(UpstreamClient(f"http://{userinfo}{authority}/base/", None)) as client:
            for _ in range(2):  # the second on the kept connection: the same bytes again
                response = await client.request(
                    "GET", "/p?q=1", CIMultiDict(headers), None, length=None, host=host, connect_timeout=10.0, read_timeout=10.0
                )
                assert (response.status, await response.read()) == (200, b"ok")
                client.release(response)
    lines = expected.replace(b"{authority}", authority.encode()).replace(b"{credentials}", CREDENTIALS.encode())
    assert heads == [b"GET /base/p?q=1 HTTP/1.1\r\n" + lines] * 2
