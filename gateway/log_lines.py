"""Log lines written off the event loop: a stalled reader costs lines, never requests.

The gateway writes two streams: the access log on stdout (gateway.proxy.access_log) and
its own log on stderr. A reader of either that stalls (Docker's and journald's log
drivers read both, so one stall hits both; a full 64 KiB pipe) would block the first
write after it, and with it the event loop. So no caller writes: `QueuedLines` formats
each record on the caller's side and hands the line to a bounded queue, and one daemon
thread per process and stream writes what is waiting, in order, with one write per
batch. A line that finds the queue full is dropped and counted, as Envoy and nginx
do; so is a line whose write fails. Closing writes the lines still queued, giving the
stream up to FLUSH_SECONDS to take them, so a blocked stream never holds an exit.

A thread does not survive fork(). The stderr handler is installed once, before the
supervisor forks its workers, and each child starts a writer of its own with an
empty queue (the lines queued at the fork are the parent's to write). A worker ends
with os._exit, past logging's own shutdown, so it closes the handler itself.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable

# How long closing waits for the stream to take the lines still queued.
FLUSH_SECONDS = 2.0
# The gateway's own log is a few lines a second at worst (store and upstream failures
# are rate-limited, or one per failed request): 1,000 lines, about 150 KB, bridge a
# reader's stall of minutes and bound what a stalled one costs in memory.
STDERR_QUEUE_LINES = 1_000

log = logging.getLogger(__name__)
_stderr: QueuedLines | None = None  # this process's gateway log, once cli installs it


class QueuedLines(logging.Handler):
    """Queues each record, formatted, for a daemon thread that writes it to `fd`, at most
    `bound` lines waiting. Logging holds the handler's lock around emit, so the bound
    check and the put are one step; a `put` from elsewhere (exit paths) may pass the
    bound by a line."""

    def __init__(self, fd: int, stream: str, bound: int) -> None:
        super().__init__()
        self._fd = fd
        self._stream = stream
        self._bound = bound
        self._count: Callable[[int], None] | None = None
        self._start()

    def _start(self) -> None:
        self.dropped = 0  # lines this process lost: the queue was full or a write failed
        self._failed = False  # the first failed write is logged, the rest only counted
        self._in_hand = 0  # lines taken from the queue by a write the stream has not finished
        self._closed = False
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_lines, name=f"{self._stream}-writer", daemon=True)
        self._writer.start()

    def restart_in_child(self) -> None:
        """After a fork: the parent's writer is gone and its queue is the parent's to write."""
        self._count = None
        self._start()

    def count_dropped(self, inc: Callable[[int], None]) -> None:
        """Pass the lines dropped so far, and each one dropped from now on, to `inc` (a counter's)."""
        self._count = inc
        if self.dropped:
            inc(self.dropped)

    @property
    def queued(self) -> int:
        """Lines not written yet: waiting, or in a write a blocked stream holds up (the writer
        takes all that wait at once: after a burst the queue can be empty and its lines still unwritten)."""
        return self._lines.qsize() + self._in_hand

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging's contract: a record that cannot be formatted is reported, never raised
            self.handleError(record)
        else:
            self.put(line)

    def put(self, line: str) -> None:
        """Queue `line` as it is, or drop and count it if `bound` lines are waiting."""
        if self._lines.qsize() >= self._bound:
            self._drop(1)
        else:
            self._lines.put(line)

    def _drop(self, lines: int) -> None:
        self.dropped += lines
        if self._count is not None:
            self._count(lines)

    def _write_lines(self) -> None:
        while True:
            lines: list[str] = []
            line = self._lines.get()
            while line is not None:
                lines.append(line)
                if self._lines.empty():
                    break
                line = self._lines.get()
            self._in_hand = len(lines)
            self._write(lines)
            self._in_hand = 0
            if line is None:  # close()'s mark: the lines before it are the last
                return

    def _write(self, lines: list[str]) -> None:
        data = memoryview("".join(line + "\n" for line in lines).encode("utf-8", "backslashreplace"))
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:  # the stream is closed: these lines are lost, and counted, like any dropped
            self._drop(len(lines))
            if not self._failed:
                self._failed = True
                log.error("log lines cannot be written to %s: %s", self._stream, exc)

    def close(self) -> None:
        """Write what is queued, waiting up to FLUSH_SECONDS for the stream to take it. Once:
        logging's shutdown at exit closes every handler again, and a stream still blocked
        then would hold the exit for another FLUSH_SECONDS."""
        if self._writer.is_alive() and not self._closed:
            self._closed = True
            self._lines.put(None)
            self._writer.join(FLUSH_SECONDS)
        super().close()


def stderr_handler() -> QueuedLines:
    """The handler for the gateway's own log, for logging.basicConfig: once per process
    tree, before any fork; each forked child gets a writer of its own."""
    global _stderr
    _stderr = QueuedLines(sys.stderr.fileno(), "stderr", STDERR_QUEUE_LINES)
    os.register_at_fork(after_in_child=_stderr.restart_in_child)
    return _stderr


def stderr_line(text: str) -> None:
    """Write `text` to stderr bare (an error that ends the process), after the log lines
    queued before it; directly when the gateway's log is not set up yet."""
    if _stderr is None:
        print(text, file=sys.stderr)
    else:
        _stderr.put(text)


def count_stderr_drops(inc: Callable[[int], None]) -> None:
    """Count the gateway log's dropped lines, this process's, with `inc` (see QueuedLines.count_dropped)."""
    if _stderr is not None:
        _stderr.count_dropped(inc)


def close_stderr_log() -> None:
    """At a worker's exit, which logging's own shutdown does not see: write the lines still queued."""
    if _stderr is not None:
        logging.getLogger().removeHandler(_stderr)
        _stderr.close()
