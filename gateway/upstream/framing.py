"""How an upstream's response is framed and whether its connection outlives it: pure
functions of the response head (as h11's `_body_framing` and `_keep_alive`), with the
rules of RFC 9112 and RFC 9110 beside the code that applies them. No I/O: the connection
(gateway.upstream.connection) calls them once a head has been parsed.

Trusts nothing in the head: where the RFC lets a recipient guess (a transfer coding list
that does not end in chunked, Transfer-Encoding in an HTTP/1.0 message, a status outside
the registry's range), the answer here is UpstreamFailed, so the attempt is a 502 and
the connection is closed, rather than a body read in a way the upstream did not mean.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from gateway.upstream.errors import UpstreamFailed


class Framing(enum.Enum):
    """Where a response body ends (RFC 9112 §6.3)."""

    NONE = "none"  # no body, whatever the head announces
    LENGTH = "length"  # after Content-Length bytes
    CHUNKED = "chunked"  # at the last chunk
    CLOSE = "close"  # at the close of the connection


# RFC 9112 §2.3: the versions of HTTP/1.x, as llhttp gives them; it parses any digit pair ("HTTP/2.0 200").
_VERSIONS = frozenset({"1.0", "1.1"})
_NONE, _LENGTH, _CHUNKED, _CLOSE = Framing.NONE, Framing.LENGTH, Framing.CHUNKED, Framing.CLOSE


def check_status_line(version: str, status: int) -> None:
    """Refuse a status line that is not HTTP/1.0 or HTTP/1.1, or whose code is outside
    100–599 (RFC 9110 §15: three digits, the first 1 to 5; a client that receives `000`
    cannot tell what happened, and relaying it would make a status of its own)."""
    if version not in _VERSIONS:
        raise UpstreamFailed(f"the status line is HTTP/{version}, not HTTP/1.0 or HTTP/1.1")
    if not 100 <= status <= 599:
        raise UpstreamFailed(f"the status code {status:03d} is outside 100-599")


def transfer_codings(values: Iterable[bytes]) -> list[bytes]:
    """The codings of every Transfer-Encoding line, in order, lower-cased, parameters
    dropped (RFC 9110 §5.3: several lines are one comma-separated list)."""
    codings = []
    for value in values:
        for coding in value.split(b","):
            coding = coding.partition(b";")[0].strip().lower()
            if coding:  # RFC 9110 §5.6.1: empty list elements are ignored
                codings.append(coding)
    return codings


def body_framing(head_only: bool, status: int, version: str, codings: list[bytes] | None, content_length: bool) -> Framing:
    """RFC 9112 §6.3, for a final response (status 200 and up) to a request the gateway
    sent (never CONNECT), once `check_status_line` holds: called here, so that a final
    head costs one call.
    `codings`: the Transfer-Encoding list (None when the field is absent);
    `content_length`: whether Content-Length is present (llhttp checks its value and
    refuses it twice)."""
    if version not in _VERSIONS or status > 599:
        check_status_line(version, status)
    # §6.3 rule 1: a response to HEAD, and every 1xx, 204 and 304, ends at its head.
    if head_only or status < 200 or status in (204, 304):
        return _NONE
    if codings is not None:
        # §6.1: Transfer-Encoding in HTTP/1.0 "MUST be treated as faulty framing".
        if version == "1.0":
            raise UpstreamFailed("Transfer-Encoding in an HTTP/1.0 response")
        # §6.3 rule 3: with Content-Length too, the message may be a smuggling attempt; a
        # recipient may refuse it, and one that relays it must drop Content-Length.
        if content_length:
            raise UpstreamFailed("Content-Length beside Transfer-Encoding")
        # §6.3 rule 4 would read any other list until the close; but `identity` is no
        # coding since RFC 7230, a list with chunked twice or not last is invalid, and
        # any other coding relayed undecoded and unlabelled would look like a plain body.
        if codings != [b"chunked"]:
            raise UpstreamFailed(f"a transfer coding list other than chunked: {b', '.join(codings).decode('latin-1')}")
        return _CHUNKED
    # §6.3 rule 6, then rule 8: without either field, the body ends with the connection.
    return _LENGTH if content_length else _CLOSE


def keep_alive(version: str, connection: list[bytes], framing: Framing) -> bool:
    """Whether the connection may carry another exchange after this response (RFC 9112
    §9.3). `connection`: the Connection field's tokens, lower-cased. The gateway's own
    requests are HTTP/1.1 without `close`, so only the response decides."""
    if framing is _CLOSE or b"close" in connection:
        return False
    # §9.3: HTTP/1.1 persists by default; HTTP/1.0 only with the keep-alive option (§C.2.2).
    return version == "1.1" or b"keep-alive" in connection
