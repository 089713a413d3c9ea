"""How an attempt upstream fails, as the upstream client raises it: one class per kind,
so that the proxy translates each into its status (502, 504) at its boundary. The
messages are for the log, never for the client."""

from __future__ import annotations


class UpstreamError(Exception):
    """An attempt that failed; the message is for the log, never for the client."""


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, TLS refused, or past the connect
    timeout with `timed_out`): nothing was sent, so another target may take the request."""

    def __init__(self, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


class UpstreamTimeout(UpstreamError):
    """Connected, but the upstream went quiet for longer than the read timeout."""


class UpstreamFailed(UpstreamError):
    """The connection broke, or the upstream sent what is not a valid HTTP/1.1 response."""


class BodyFailed(UpstreamError):
    """The request body's source failed (the client stalled or went away) while it was sent."""
