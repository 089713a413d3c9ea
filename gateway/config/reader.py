"""The framework every part of the config parser reads the YAML with, and its one error.

`_Reader` walks the parsed document and remembers the YAML path (such as
`routes[1].limits[0].name`), so every failure names the file, the path and what was
expected, in one line. `_interpolate` replaces `${VAR}` from the environment before
anything is read. Trusts nothing it is given: the document and the environment are
both the user's. Names with a leading underscore are private to gateway.config.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn
from urllib.parse import SplitResult, urlsplit

import yaml

from gateway.config import safe_yaml

# The most tokens, requests or leases a limit counts. Redis and Lua keep counts as
# doubles, which hold whole numbers exactly only up to 2^53: a bucket of 1e20 tokens
# never goes down by one. 10^15 leaves room for fractional refills.
MAX_COUNT = 10**15
# `${VAR}`, `${VAR:-default}`, or `$$` for a literal dollar sign.
_INTERPOLATION_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """An invalid config file; str() is the one line shown to the user. Characters that are
    not printable (a key holding a newline, a value with a control character) are escaped
    as Python writes them, so the message stays one line and writes nothing to a terminal."""

    def __init__(self, message: str) -> None:
        if not message.isprintable():
            message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        super().__init__(message)


class _Reader:
    """Walks the parsed document, remembering the YAML path for error messages."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> NoReturn:
        where = f"{self.source}: {path}" if path else self.source
        raise ConfigError(f"{where}: {message}")

    def mapping(
        self, value: Any, path: str, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
    ) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {_type_name(value)}")
        for key in value:
            if key not in required and key not in optional:
                allowed = ", ".join(required + optional)
                self.fail(_join(path, str(key)), f"unknown key (expected one of: {allowed})")
        for key in required:
            if key not in value:
                self.fail(_join(path, key), "required key is missing")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(path, f"expected a non-empty string, got {_type_name(value)}")
        return value

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false, got {_type_name(value)}")
        return value

    def integer(self, value: Any, path: str, *, minimum: int, maximum: int = MAX_COUNT) -> int:
        """A whole number in [minimum, maximum]: every number in the config has a finite range."""
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer, got {_type_name(value)}")
        if value < minimum:
            self.fail(path, f"expected an integer >= {minimum}, got {_shown_integer(value)}")
        if value > maximum:
            self.fail(path, f"expected an integer <= {maximum:,}, got {_shown_integer(value)}")
        return value

    def count(self, value: Any, path: str) -> int:
        """A number of tokens, requests or leases: from 1 to MAX_COUNT."""
        return self.integer(value, path, minimum=1, maximum=MAX_COUNT)

    def sequence(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, f"expected a list, got {_type_name(value)}")
        return value

    def parsed(self, parse: Callable[[Any], Any], value: Any, path: str) -> Any:
        try:
            return parse(value)
        except ValueError as exc:
            self.fail(path, str(exc))


def _interpolate(value: Any, path: str, environ: Mapping[str, str], reader: _Reader) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, _join(path, str(k)), environ, reader) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{path}[{i}]", environ, reader) for i, v in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        reader.fail(path, f"environment variable {name} is not set and has no default (${{{name}:-default}})")

    result = _INTERPOLATION_RE.sub(substitute, value)
    if _INTERPOLATION_RE.fullmatch(value) and value != "$$":
        # A value that is one whole ${VAR} takes the type its text has in YAML,
        # so `workers: ${WORKERS:-1}` is an integer, not the string "1".
        try:
            scalar = safe_yaml.load(result) if result else result
        except yaml.YAMLError:
            return result
        if isinstance(scalar, (int, float, bool)) or scalar is None:
            return scalar
    return result


def _choice(kind: type[enum.Enum], value: Any, path: str, r: _Reader) -> Any:
    try:
        return kind(value)
    except ValueError:
        *others, last = (member.value for member in kind)
        r.fail(path, f"expected {', '.join(others)} or {last}, got {value!r}")


def _split_url(url: str, path: str, r: _Reader, *, shown: str | None = None) -> SplitResult:
    """urlsplit, with its ValueError (an unclosed `[`, or a bracketed host that is no IPv6
    address) made a config error."""
    try:
        return urlsplit(url)
    except ValueError as exc:
        r.fail(path, f"not a URL ({exc}): {shown or url!r}")


def _shown_integer(value: int) -> str:
    """`value` for an error line, its digits grouped; past 40 digits not its digits, so the
    line stays readable (and int-to-str's 4300-digit limit is never reached)."""
    return f"{value:,}" if abs(value) < 10**40 else f"{'-' if value < 0 else ''}a number past 10**40"


def _join(path: str, key: str) -> str:
    if not key or key != key.strip() or any(c in key for c in ".:[]'"):
        key = repr(key)  # a key that would read as part of the path, or as none
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
    if value is None:
        return "nothing (null)"
    return names.get(type(value), type(value).__name__)
