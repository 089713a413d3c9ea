"""Parsers for the small value languages inside the YAML: rates, durations, sizes, addresses.

Each parser trusts nothing in the raw YAML scalar: it returns a typed value or
raises ValueError with a message that says what was expected. The caller adds the
file name and YAML path.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# A month is 30 days and a year 365: a rate is a steady refill, so its period has one
# length (calendar months and years are what `quota` windows are for).
DAY_SECONDS = 86400.0
_PERIOD_WORDS = {
    "second": 1.0, "minute": 60.0, "hour": 3600.0, "day": DAY_SECONDS,
    "month": 30 * DAY_SECONDS, "year": 365 * DAY_SECONDS,
}
# ASCII only: \d would otherwise accept digits such as '٣' or '²'.
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$", re.ASCII)
_SIZE_RE = re.compile(r"^\s*(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?\s*$", re.ASCII)
_UNIT_BYTES = {None: 1, "B": 1, "KB": 1000, "KiB": 1024, "MB": 1000**2, "MiB": 1024**2, "GB": 1000**3, "GiB": 1024**3}
_TIME_OF_DAY_RE = re.compile(r"^\s*([01]\d|2[0-3]):([0-5]\d)(?:\s+UTC)?\s*$", re.ASCII)
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\S+)\s*$", re.ASCII)
# Every number the config holds has a finite range, so no 400-digit value becomes inf (or
# 0) in float arithmetic. A microsecond is below any timer the event loop keeps; a year is
# the longest rate period there is a word for, and longer waits are what quotas are for.
MIN_DURATION = 0.000001
MAX_DURATION = 365 * 86400.0
# The slowest refill is one token a year: slower, a bucket's refill time and its
# RateLimit-Policy window leave what a float or a header can say.
MIN_RATE_PER_SECOND = 1 / MAX_DURATION
# 1 TiB: past what any header, body or buffer cap could mean, and exact in a float.
MAX_SIZE = 1024**4


@dataclass(frozen=True)
class Rate:
    """A refill rate: `tokens` per `period_seconds`, kept as written for display."""

    tokens: float
    period_seconds: float
    text: str

    @property
    def per_second(self) -> float:
        return self.tokens / self.period_seconds


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_duration(value: object) -> float:
    """'10ms', '1.5s', '2m', '1h', '1d' -> seconds."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"expected a duration with a unit such as 10ms, 2s or 1m, got {value!r}")
    match = _DURATION_RE.match(value)
    if not match:
        raise ValueError(f"expected a duration with a unit such as 10ms, 2s or 1m, got {value!r}")
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds <= 0:
        raise ValueError(f"expected a duration greater than zero, got {value!r}")
    if not MIN_DURATION <= seconds <= MAX_DURATION:
        raise ValueError(f"expected a duration from 0.001ms to 365d, got {_shown(value)}")
    return seconds


def _shown(value: str) -> str:
    """`value` for an error line: a 400-digit number is cut, so the line stays readable."""
    return repr(value) if len(value) <= 40 else repr(value[:30] + "...") + f" ({len(value)} characters)"


def parse_size(value: object) -> int:
    """'32KiB', '1MB', '10MiB', '512B', or a whole number of bytes -> bytes."""
    expected = "expected a size such as 32KiB, 1MB or 10MiB (or a number of bytes)"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{expected}, got {value!r}")
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"{expected}, got {value!r}")
    size = int(match.group(1)) * _UNIT_BYTES[match.group(2)]
    if size <= 0:
        raise ValueError(f"expected a size greater than zero, got {value!r}")
    if size > MAX_SIZE:
        raise ValueError(f"expected a size of at most 1024GiB, got {_shown(str(value))}")
    return size


def parse_rate(value: object) -> Rate:
    """'100/minute', '5/second', '1/hour', '10/day', '1000/month' (30 days), '5000/year' (365 days),
    '100/10s', '3/500ms' -> Rate."""
    expected = "expected a rate such as 100/minute, 5/second, 1000/month, 100/10s or 3/500ms"
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"{expected}, got {value!r}")
    match = _RATE_RE.match(value)
    if not match:
        raise ValueError(f"{expected}, got {value!r}")
    tokens = float(match.group(1))
    if not math.isfinite(tokens):
        raise ValueError(f"expected a rate with a count of at most 1e300, got {_shown(value)}")
    period = match.group(2)
    if period in _PERIOD_WORDS:
        seconds = _PERIOD_WORDS[period]
    else:
        try:
            seconds = parse_duration(period)
        except ValueError:
            if _DURATION_RE.match(period):
                raise ValueError(f"expected a rate whose period is from 0.001ms to 365d, got {_shown(value)}") from None
            raise ValueError(f"{expected}, got {value!r}") from None
    if tokens <= 0:
        raise ValueError(f"expected a rate greater than zero, got {_shown(value)}")
    if not tokens / seconds >= MIN_RATE_PER_SECOND:  # also false for inf / inf
        raise ValueError(f"expected a rate of at least 1/year, got {_shown(value)}")
    return Rate(tokens=tokens, period_seconds=seconds, text=value.strip())


def parse_time_of_day(value: object) -> float:
    """'00:00 UTC', '13:30 UTC' or '13:30' -> seconds after midnight UTC."""
    if not isinstance(value, str) or not (match := _TIME_OF_DAY_RE.match(value)):
        raise ValueError(f"expected a time of day in UTC such as \"00:00 UTC\" or \"13:30 UTC\", got {value!r}")
    return int(match.group(1)) * 3600.0 + int(match.group(2)) * 60.0


def parse_address(value: object) -> Address:
    """'0.0.0.0:8080', '[::1]:8080', 'localhost:8080' -> Address."""
    expected = "expected HOST:PORT such as 0.0.0.0:8080 or [::1]:8080"
    if not isinstance(value, str):
        raise ValueError(f"{expected}, got {value!r}")
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"{expected}, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{expected}, got {value!r}") from None
    elif ":" in host or not re.fullmatch(r"[A-Za-z0-9.\-]+", host):
        raise ValueError(f"{expected}, got {value!r}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    return Address(host=host, port=port)

