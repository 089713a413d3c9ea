"""Bucket resets made through one worker's admin API, seen by its sibling workers.

With `workers: N` an admin request reaches whichever worker accepts its connection,
but every worker keeps its own cached denials, leased tokens and stand-in buckets of
a client. A reset that only the answering worker applied would leave the client denied
by the others until their cached denials run out (up to an hour, on a limit of 1/hour).

So the supervisor maps a small log of resets, shared by the workers it forks: the
answering worker appends (limit name, identity) before it answers, and every worker
looks at the log's sequence number before each check and applies what it has not
seen. A request sent after the reset's answer is therefore decided afresh by any
worker. The log is a ring of SLOTS entries: a worker that fell further behind (more
resets than that between two of its checks) drops all its cached denials instead,
which costs only store calls.

Writers take a lock (held for a copy of at most SLOT_BYTES); readers take none: they
read the entries, then the sequence again, and treat entries a writer may have been
overwriting meanwhile as lost.
"""

from __future__ import annotations

import mmap
import multiprocessing
import struct

SLOTS = 256  # far more resets than an operator makes between two requests
SLOT_BYTES = 1024  # a limit name and an identity (a header value, at most max_header_size, may not fit)
_SEQUENCE = struct.Struct("<Q")
_LENGTH = struct.Struct("<H")
_SEPARATOR = b"\0"


class WorkerResets:
    """Made before the workers are forked; each worker then reads and writes the same memory."""

    def __init__(self) -> None:
        # Anonymous and MAP_SHARED: the forked workers see one another's writes.
        self._memory = mmap.mmap(-1, _SEQUENCE.size + SLOTS * SLOT_BYTES)
        self._lock = multiprocessing.get_context("fork").Lock()
        self._seen = 0

    def publish(self, limit_name: str, identity: str) -> None:
        """Tell every worker that this bucket was reset. One too long for a slot is an empty
        entry, which tells them to drop every cached denial."""
        entry = limit_name.encode() + _SEPARATOR + identity.encode()
        if len(entry) > SLOT_BYTES - _LENGTH.size:
            entry = b""
        memory = self._memory
        with self._lock:
            sequence = _SEQUENCE.unpack_from(memory, 0)[0] + 1
            offset = _slot(sequence)
            _LENGTH.pack_into(memory, offset, len(entry))
            memory[offset + _LENGTH.size : offset + _LENGTH.size + len(entry)] = entry
            _SEQUENCE.pack_into(memory, 0, sequence)

    def unseen(self) -> list[tuple[str, str]] | None:
        """The resets published since the last call, oldest first: [] if none (the usual
        case, one read), None if some were lost (drop every cached denial)."""
        memory = self._memory
        sequence = _SEQUENCE.unpack_from(memory, 0)[0]
        seen = self._seen
        if sequence == seen:
            return []
        entries = []
        for number in range(max(seen + 1, sequence - SLOTS + 1), sequence + 1):
            offset = _slot(number)
            length = _LENGTH.unpack_from(memory, offset)[0]
            entries.append(bytes(memory[offset + _LENGTH.size : offset + _LENGTH.size + length]))
        now = _SEQUENCE.unpack_from(memory, 0)[0]
        self._seen = sequence
        # The next write after `now` goes to the slot of entry now + 1 - SLOTS.
        if seen + 1 <= now + 1 - SLOTS or b"" in entries:
            return None
        return [(name.decode(), identity.decode()) for name, _, identity in (e.partition(_SEPARATOR) for e in entries)]


def _slot(number: int) -> int:
    return _SEQUENCE.size + (number % SLOTS) * SLOT_BYTES
