"""The config keys that bound clients: nginx's defaults where the original report is
silent, and one-line errors naming the YAML path."""

import pytest

from gateway.config import ConfigError, parse_config
from gateway.config.model import ClientLimits
from gateway.config.units import parse_size

SOURCE = "gw.yaml"
ROUTE = "routes:\n  - match: {path: /}\n    upstream: http://127.0.0.1:9000\n"


def parse(text: str):
    return parse_config(text, source=SOURCE, environ={})


def test_defaults_are_nginx_s_and_a_32_kib_head():
    config = parse(ROUTE)
    assert config.clients == ClientLimits(
        header_timeout=60.0, body_timeout=60.0, keepalive_timeout=75.0, keepalive_requests=1000, max_header_size=32768
    )
    assert config.upstream_connections == 1000
    assert (config.upstream_max_header_size, config.upstream_max_header_lines) == (65536, 100)
    (route,) = config.routes
    assert route.max_body_size is None
    assert route.timeout.queue == 1.0


def test_every_key_is_read():
    config = parse(
        "client_header_timeout: 10s\nclient_body_timeout: 500ms\nkeepalive_timeout: 2m\nkeepalive_requests: 50\n"
        "max_header_size: 64KiB\nupstream_connections: 200\n"
        "upstream_max_header_size: 128KiB\nupstream_max_header_lines: 200\n"
        "routes:\n  - match: {path: /}\n    upstream: http://h:1\n    max_body_size: 10MB\n    timeout: {queue: 250ms}\n"
    )
    assert config.clients == ClientLimits(
        header_timeout=10.0, body_timeout=0.5, keepalive_timeout=120.0, keepalive_requests=50, max_header_size=65536
    )
    assert config.upstream_connections == 200
    assert (config.upstream_max_header_size, config.upstream_max_header_lines) == (131072, 200)
    assert config.routes[0].max_body_size == 10_000_000
    assert config.routes[0].timeout.queue == 0.25


@pytest.mark.parametrize(
    "text, size", [("512", 512), (4096, 4096), ("1KB", 1000), ("32KiB", 32768), ("2 MiB", 2 << 20), ("1GB", 10**9)]
)
def test_sizes_take_a_unit_or_a_number_of_bytes(text, size):
    assert parse_size(text) == size


ERRORS = {
    "client_header_timeout without a unit": ("client_header_timeout: 60\n", "client_header_timeout: expected a duration"),
    "client_body_timeout zero": ("client_body_timeout: 0s\n", "client_body_timeout: expected a duration greater than zero"),
    "keepalive_timeout a word": ("keepalive_timeout: long\n", "keepalive_timeout: expected a duration"),
    "keepalive_requests zero": ("keepalive_requests: 0\n", "keepalive_requests: expected an integer >= 1, got 0"),
    "max_header_size a unit alone": ("max_header_size: KiB\n", "max_header_size: expected a size such as 32KiB"),
    "max_header_size negative": ("max_header_size: -1\n", "max_header_size: expected a size"),
    "max_header_size a fraction": ("max_header_size: 1.5KiB\n", "max_header_size: expected a size"),
    "upstream_connections zero": ("upstream_connections: 0\n", "upstream_connections: expected an integer >= 1"),
    "upstream_max_header_size a word": ("upstream_max_header_size: big\n", "upstream_max_header_size: expected a size such as 32KiB"),
    "upstream_max_header_size zero": ("upstream_max_header_size: 0\n", "upstream_max_header_size: expected a size greater than zero"),
    "upstream_max_header_lines zero": ("upstream_max_header_lines: 0\n", "upstream_max_header_lines: expected an integer >= 1, got 0"),
    "upstream_max_header_lines a size": ("upstream_max_header_lines: 1KiB\n", "upstream_max_header_lines: expected an integer, got a string"),
}


@pytest.mark.parametrize("text, expected", ERRORS.values(), ids=ERRORS.keys())
def test_invalid_top_level_keys_are_one_line_naming_the_key(text, expected):
    with pytest.raises(ConfigError) as info:
        parse(text + ROUTE)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{SOURCE}: {expected}"), message


@pytest.mark.parametrize(
    "route, expected",
    [
        ("max_body_size: lots", "routes[0].max_body_size: expected a size"),
        ("max_body_size: 0", "routes[0].max_body_size: expected a size greater than zero"),
        ("timeout: {queue: 1}", "routes[0].timeout.queue: expected a duration"),
        ("timeout: {queue: 0ms}", "routes[0].timeout.queue: expected a duration greater than zero"),
    ],
)
def test_invalid_route_keys_name_their_route(route, expected):
    with pytest.raises(ConfigError) as info:
        parse(f"routes:\n  - match: {{path: /}}\n    upstream: http://h:1\n    {route}\n")
    assert str(info.value).startswith(f"{SOURCE}: {expected}"), str(info.value)
