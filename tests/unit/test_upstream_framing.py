"""gateway.upstream.framing without a socket: where a response body ends and whether its
connection outlives it (RFC 9112 §6.3 and §9.3), and which status lines and transfer
codings are refused. The same rules reach the wire in test_upstream_strict.py."""

from __future__ import annotations

import pytest

from gateway.upstream.errors import UpstreamFailed
from gateway.upstream.framing import Framing, body_framing, check_status_line, keep_alive, transfer_codings

V11 = "1.1"  # as llhttp gives it
V10 = "1.0"


def framing(
    status: int = 200, *, head_only: bool = False, version: str = V11,
    codings: list[bytes] | None = None, content_length: bool = False,
) -> Framing:
    return body_framing(head_only=head_only, status=status, version=version, codings=codings, content_length=content_length)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"content_length": True}, Framing.LENGTH),
        ({"codings": [b"chunked"]}, Framing.CHUNKED),
        ({}, Framing.CLOSE),  # rule 8: neither field, the body ends with the connection
        ({"version": V10}, Framing.CLOSE),
        ({"version": V10, "content_length": True}, Framing.LENGTH),
        # Rule 1: no body whatever the head announces.
        ({"head_only": True, "content_length": True}, Framing.NONE),
        ({"head_only": True, "codings": [b"chunked"]}, Framing.NONE),
        ({"status": 204, "content_length": True}, Framing.NONE),
        ({"status": 304, "codings": [b"chunked"]}, Framing.NONE),
        ({"status": 103}, Framing.NONE),
    ],
    ids=[
        "Content-Length", "chunked", "neither", "HTTP/1.0 neither", "HTTP/1.0 Content-Length",
        "HEAD with Content-Length", "HEAD chunked", "204 with Content-Length", "304 chunked", "103",
    ],
)
def test_body_framing(kwargs: dict, expected: Framing) -> None:
    assert framing(**kwargs) is expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"codings": [b"chunked", b"identity"]},
        {"codings": [b"identity"]},
        {"codings": [b"identity", b"chunked"]},
        {"codings": [b"chunked", b"chunked"]},
        {"codings": [b"gzip", b"chunked"]},
        {"codings": [b"gzip"]},
        {"codings": []},  # `Transfer-Encoding:` with no coding
        {"codings": [b"chunked"], "content_length": True},
        {"codings": [b"chunked"], "version": V10},
    ],
    ids=[
        "chunked, identity", "identity", "identity, chunked", "chunked twice", "gzip, chunked", "gzip",
        "empty", "beside Content-Length", "in HTTP/1.0",
    ],
)
def test_body_framing_refuses_every_transfer_coding_list_but_chunked(kwargs: dict) -> None:
    with pytest.raises(UpstreamFailed):
        framing(**kwargs)


def test_transfer_codings_join_lines_and_drop_parameters_and_empty_elements() -> None:
    assert transfer_codings([b"Chunked ;q=1", b" , IDENTITY,"]) == [b"chunked", b"identity"]
    assert transfer_codings([b""]) == []


@pytest.mark.parametrize(
    "version, connection, framing_, kept",
    [
        (V11, [], Framing.LENGTH, True),
        (V11, [b"close"], Framing.LENGTH, False),
        (V11, [b"keep-alive", b"close"], Framing.CHUNKED, False),
        (V11, [], Framing.CLOSE, False),  # the body ends with the connection
        (V11, [], Framing.NONE, True),
        (V10, [], Framing.LENGTH, False),  # HTTP/1.0 closes unless asked not to
        (V10, [b"keep-alive"], Framing.LENGTH, True),
        (V10, [b"keep-alive"], Framing.CLOSE, False),
    ],
)
def test_keep_alive(version: str, connection: list[bytes], framing_: Framing, kept: bool) -> None:
    assert keep_alive(version=version, connection=connection, framing=framing_) is kept


@pytest.mark.parametrize("version, status", [(V11, 100), (V11, 200), (V10, 404), (V11, 599)])
def test_status_lines_accepted(version: str, status: int) -> None:
    check_status_line(version, status)


@pytest.mark.parametrize(
    "version, status",
    [(V11, 0), (V11, 99), (V11, 600), (V11, 999), ("2.0", 200), ("1.2", 200), ("0.9", 200), ("0.0", 200)],
)
def test_status_lines_refused(version: str, status: int) -> None:
    with pytest.raises(UpstreamFailed):
        check_status_line(version, status)
