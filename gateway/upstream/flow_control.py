"""Backpressure on one upstream connection, both ways (as uvicorn's flow_control.py):
reading from the upstream pauses while the caller has not taken the body it holds, and
sending a request body pauses while the upstream does not take it. Each call is
idempotent, so the connection calls them whenever its state says so, without keeping
a copy of that state elsewhere. Trusts its transport only."""

from __future__ import annotations

import asyncio


class FlowControl:
    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None  # made only when a writer waits

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()  # a closing transport ignores it

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        """Also called when the connection is lost, so that a writer never waits on it."""
        self.write_paused = False
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    async def drain(self) -> None:
        """Return once the transport takes writes again (at once when it does now)."""
        if self.write_paused:
            if self._writable is None:
                self._writable = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._writable)  # one writer cancelled leaves it for the others
