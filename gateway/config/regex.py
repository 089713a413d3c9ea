"""Regular expressions from the config, run by RE2 in time linear in what they read.

A route's regex runs on what a client sends: its path, a header, a query value.
Python's `re` backtracks and has no timeout, so `(a+)+b` against thirty `a`s
runs for minutes; which patterns backtrack badly cannot be told reliably from
their text (`\\d*\\d*\\d*x` is polynomial, and a path can be 32 KiB). RE2
(google-re2, Google's engine behind Envoy's and Go's regexes) runs every pattern
in time linear in its input, whatever the pattern. In exchange it has no
backreferences and no lookaround: a pattern that uses them is refused at load.

Patterns match a value whole (fullmatch), as Envoy's `safe_regex` does, so
`/api/v[0-9]+` never matches `/api/v1/admin` by accident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import re2


@dataclass(frozen=True)
class Regex:
    """A compiled pattern, compared and shown by its text."""

    pattern: str
    case_sensitive: bool = True
    _compiled: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def compile(cls, pattern: str, *, case_sensitive: bool = True) -> Regex:
        """Raises ValueError, saying why in one line, for a pattern RE2 does not take."""
        options = re2.Options()
        options.never_capture = True  # only whether it matches is read: faster
        options.log_errors = False  # the error is ours to report, not a line on stderr
        options.case_sensitive = case_sensitive
        try:
            compiled = re2.compile(pattern, options)
        except re2.error as exc:
            reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
            raise ValueError(f"not a regular expression RE2 takes ({reason})") from None
        return cls(pattern, case_sensitive, compiled)

    def fullmatch(self, text: str) -> bool:
        # Bytes skip the wrapper's offset bookkeeping for str. surrogatepass: a header
        # value that was not UTF-8 arrives with surrogates, and must not raise here.
        return self._compiled.fullmatch(text.encode("utf-8", "surrogatepass")) is not None

    def __str__(self) -> str:
        return self.pattern
