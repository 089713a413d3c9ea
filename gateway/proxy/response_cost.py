"""Reading an admitted request's cost from its response as it is relayed, and settling it
when the relay ends (gateway.decision.settle).

One `CostMeter` per request on a route with limits whose cost the response says. The relay
tells it the upstream's head (`head`), each body chunk as it passes (`feed`; nothing is kept
but what the readers keep), and the end (`finish`), which a response relayed to its end
awaits before its last bytes go, so the client's next request finds the settlement made.
Every other end (the client gone, the upstream failed or slow mid-body, a shutdown) reaches
`finish` from the handler when the request ends. What each limit is charged:
- what its reader says of the bytes relayed so far (a client gone mid-stream included);
- its `missing`, when the response did not say (no usage, a malformed one, one cut off
  before it came), and for a WebSocket, whose frames are not read;
- nothing (0), when no response came from the upstream at all: a connect failure, a timeout
  before the head, no target; the reservation goes back.

Trusts nothing in the response: a reader's answer is a whole number or nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from gateway.config.usage import SILENT, UsageReader
from gateway.decision.settle import Reservations


class CostMeter:
    __slots__ = ("_readers", "_reservations")

    def __init__(self, reservations: Reservations) -> None:
        self._reservations = reservations
        self._readers: list[UsageReader] | None = None  # None until the upstream's head came

    def head(self, headers: Mapping[str, str]) -> None:
        """The upstream answered with `headers`: its body is read from here on."""
        self._readers = [cost.source.reader(headers) for cost in self._reservations.costs]

    def unread(self) -> None:
        """The upstream answered, but its body is not read (a WebSocket's frames): `missing` each."""
        self._readers = [SILENT for _ in self._reservations.costs]

    def feed(self, chunk: bytes) -> None:
        readers = self._readers
        assert readers is not None  # the head comes first
        for reader in readers:
            reader.feed(chunk)

    async def finish(self) -> None:
        """Settle what the response said; once (a later call does nothing)."""
        reservations = self._reservations
        if reservations.settled:
            return
        readers = self._readers
        if readers is None:
            actuals = [0] * len(reservations.costs)
        else:
            actuals = []
            for reader, cost in zip(readers, reservations.costs):
                said = reader.result()
                actuals.append(cost.missing if said is None else said)
        # Shielded: a client that hangs up now cancels its request, not the settlement.
        await asyncio.shield(reservations.settle(actuals))
