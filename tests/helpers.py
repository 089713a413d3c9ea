"""Small helpers more than one test module uses: reading config errors and Redis's script calls."""

from __future__ import annotations

import pytest
import redis

from gateway.config import ConfigError, parse_config

SOURCE = "gw.yaml"  # the file name a parsed text is given, and every error it raises starts with


def error_of(text: str, environ: dict[str, str] | None = None, *, source: str = SOURCE) -> str:
    """The ConfigError parsing `text` raises, as one line that starts with the file's name."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, source=source, environ=environ or {})
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{source}: "), message
    return message


def script_calls(client: redis.Redis) -> int:
    """How many EVALSHA calls the Redis behind `client` has answered since it started."""
    return client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
