"""The small value languages inside the YAML: rates, durations and listen addresses."""

import pytest

from gateway.config.units import (
    Address,
    Rate,
    parse_address,
    parse_duration,
    parse_rate,
    parse_size,
)

# Numbers that leave what a float holds: 400 digits read as inf, and 0.(315 zeros)1 as a denormal.
HUGE = "1" + "0" * 400
NINES = "9" * 400
DENORMAL = "0." + "0" * 315 + "1"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("10ms", 0.01),
        ("1.5s", 1.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1d", 86400.0),
        (" 3 s ", 3.0),
        ("0.5ms", 0.0005),
    ],
)
def test_parse_duration_accepts_a_number_with_a_unit(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    ["10", 10, 1.5, True, None, "", "ms", "10 sec", "10S", "-1s", "1e3s", "10msx", "1..5s", "٣s", "0s", "0ms", "0.0s"],
)
def test_parse_duration_rejects_anything_else(value):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(value)


@pytest.mark.parametrize(
    ("text", "tokens", "period"),
    [
        ("5/second", 5, 1.0),
        ("100/minute", 100, 60.0),
        ("1/hour", 1, 3600.0),
        ("10/day", 10, 86400.0),
        ("1000/month", 1000, 30 * 86400.0),
        ("5000/year", 5000, 365 * 86400.0),
        ("100/10s", 100, 10.0),
        ("3/500ms", 3, 0.5),
        ("2.5/second", 2.5, 1.0),
        ("  7 / 2m ", 7, 120.0),
    ],
)
def test_parse_rate_reads_count_and_period(text, tokens, period):
    rate = parse_rate(text)
    assert (rate.tokens, rate.period_seconds) == (tokens, pytest.approx(period))
    assert rate.per_second == pytest.approx(tokens / period)
    assert rate.text == text.strip()


@pytest.mark.parametrize(
    "value",
    ["100", "100/", "/minute", "100/minutes", "100/week", "100/months", "100/0s", "0/second", "-1/second", "100/10", "1e2/second",
     "abc/second", 100, None, True, "100/minute/2", "٣/second"],
)
def test_parse_rate_rejects_anything_else(value):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(value)


def test_rate_and_address_are_immutable():
    rate = parse_rate("1/second")
    address = parse_address("127.0.0.1:80")
    with pytest.raises(AttributeError):
        rate.tokens = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        address.port = 81  # type: ignore[misc]
    assert rate == Rate(tokens=1.0, period_seconds=1.0, text="1/second")


@pytest.mark.parametrize(
    ("text", "host", "port", "shown"),
    [
        ("0.0.0.0:8080", "0.0.0.0", 8080, "0.0.0.0:8080"),
        ("127.0.0.1:0", "127.0.0.1", 0, "127.0.0.1:0"),
        ("localhost:65535", "localhost", 65535, "localhost:65535"),
        ("[::1]:9090", "::1", 9090, "[::1]:9090"),
        ("[::]:80", "::", 80, "[::]:80"),
        ("gw-1.internal:443", "gw-1.internal", 443, "gw-1.internal:443"),
    ],
)
def test_parse_address_reads_host_and_port(text, host, port, shown):
    address = parse_address(text)
    assert address == Address(host=host, port=port)
    assert str(address) == shown


@pytest.mark.parametrize(
    "value",
    ["8080", 8080, ":8080", "host:", "host:http", "::1:8080", "[::1]", "[not-ipv6]:80", "[1.2.3.4]:80", "host:-1",
     "host:65536", "host:99999", "ho st:80", "host:８０", "host:²", "http://host:80", None],
)
def test_parse_address_rejects_anything_else(value):
    with pytest.raises(ValueError, match=r"HOST:PORT|port must be"):
        parse_address(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (HUGE + "s", "expected a duration from 0.001ms to 365d, got '1000000"),
        ("366d", "from 0.001ms to 365d, got '366d'"),
        ("0.0001ms", "from 0.001ms to 365d"),
        (DENORMAL + "s", "from 0.001ms to 365d"),
    ],
)
def test_a_duration_outside_its_finite_range_is_refused(value, expected):
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert expected in str(info.value)
    assert len(str(info.value)) < 120, "a 400-digit value is cut, not repeated whole"


def test_the_ends_of_the_duration_range_are_accepted():
    assert (parse_duration("0.001ms"), parse_duration("365d")) == (pytest.approx(0.000001), 365 * 86400.0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (f"1/{NINES}s", "expected a rate whose period is from 0.001ms to 365d"),
        (f"{DENORMAL}/second", "expected a rate of at least 1/year"),
        ("1/400d", "expected a rate whose period is from 0.001ms to 365d"),
        ("0.5/year", "expected a rate of at least 1/year"),
        (f"{HUGE}/second", "expected a rate with a count of at most 1e300"),
    ],
)
def test_a_rate_outside_its_finite_range_is_refused(value, expected):
    with pytest.raises(ValueError) as info:
        parse_rate(value)
    assert expected in str(info.value)


def test_a_size_past_a_tebibyte_is_refused():
    assert parse_size("1024GiB") == 1024**4
    with pytest.raises(ValueError, match="expected a size of at most 1024GiB"):
        parse_size("1025GiB")
    with pytest.raises(ValueError, match="expected a size of at most 1024GiB"):
        parse_size(HUGE)
