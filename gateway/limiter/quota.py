"""Fixed-window quotas: the reference model of a counter that resets at a calendar
boundary. No I/O, no clock.

A window is `per` long (an hour, a day, a week, or a calendar month) and starts
at `offset` into it (the configured reset time of day, UTC): hours start at the
offset's minutes past the hour, days at the offset, weeks on Monday at the
offset, and months on the 1st at the offset. Times are milliseconds since the
Unix epoch, as the Lua script reads them from Redis's TIME, so both carriers
compute each boundary with the same operations on the same doubles.
`lua/token_bucket.lua` carries this model; the in-process store calls it.

Calendar months use the proleptic Gregorian calendar (Howard Hinnant's
`days_from_civil` and `civil_from_days`, integer arithmetic only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DAY_MS = 86_400_000
WEEK_MS = 7 * DAY_MS
# 1970-01-01 was a Thursday: weeks start on Monday, four days later.
WEEK_START_MS = 4 * DAY_MS
MONTH = 0  # the `period_ms` of a calendar month, whose length varies


# The fixed window lengths of `quota.per`; a month follows the calendar.
PERIOD_MS = {"hour": 3_600_000, "day": DAY_MS, "week": WEEK_MS, "month": MONTH}


def spec_of(per: str, reset_seconds: float, limit: float, cost: float, *, owed: bool = False) -> QuotaSpec:
    """The spec of a configured quota: windows `per` long, starting `reset_seconds` into the
    UTC day (an hour's at that many minutes past the hour; a week's on Monday)."""
    period = PERIOD_MS[per]
    offset = reset_seconds * 1000
    if per == "hour":
        offset %= period
    elif per == "week":
        offset += WEEK_START_MS
    return QuotaSpec(limit=limit, period_ms=period, offset_ms=offset, cost=cost, owed=owed)


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    limit: float  # units a window admits
    period_ms: float  # the window's length; MONTH for calendar months
    offset_ms: float  # where windows start within the period (for weeks, counted from Monday 00:00 UTC)
    cost: float
    owed: bool = False  # counted even when refused, past the limit (gateway.limiter.bucket)


@dataclass(frozen=True, slots=True)
class QuotaState:
    count: float  # units charged in the window that starts at `start`
    start: float  # ms since the epoch


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a date in the proleptic Gregorian calendar."""
    year -= month <= 2
    era = (year if year >= 0 else year - 399) // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a day counted from 1970-01-01."""
    days += 719468
    era = (days if days >= 0 else days - 146096) // 146097
    doe = days - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + (3 if mp < 10 else -9)
    return yoe + era * 400 + (month <= 2), month, day


def window(spec: QuotaSpec, now: float) -> tuple[float, float]:
    """The (start, end) in ms of the window holding `now`: start <= now < end."""
    if spec.period_ms == MONTH:
        # The reset time shifts the day boundary: before it, the 1st still belongs to the month before.
        year, month, _ = civil_from_days(math.floor((now - spec.offset_ms) / DAY_MS))
        start = days_from_civil(year, month, 1) * DAY_MS + spec.offset_ms
        following = (year + 1, 1) if month == 12 else (year, month + 1)
        return start, days_from_civil(*following, 1) * DAY_MS + spec.offset_ms
    start = math.floor((now - spec.offset_ms) / spec.period_ms) * spec.period_ms + spec.offset_ms
    return start, start + spec.period_ms


def used(state: QuotaState | None, spec: QuotaSpec, now: float) -> tuple[float, float, float]:
    """(count so far in the window holding `now`, its start, its end). A counter of an
    earlier window counts nothing; one of a later window (a clock that stepped back
    across a boundary) stays the current one, so a step back never resets a quota."""
    start, end = window(spec, now)
    if state is None or state.start < start:
        return 0.0, start, end
    if state.start > start:
        start, end = window(spec, state.start)
    return state.count, start, end
