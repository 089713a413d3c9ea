"""The framework every part of the config parser reads the YAML with, and its one error.

`_Reader` walks the parsed document and remembers the YAML path (such as
`routes[1].limits[0].name`), so every failure names the file, the path and what was
expected, in one line. `_interpolate` replaces `${VAR}` from the environment before
anything is read. Trusts nothing it is given: the document and the environment are
both the user's. Names with a leading underscore are private to gateway.config.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, ParamSpec, TypeVar
from urllib.parse import SplitResult, urlsplit

import yaml

from gateway.config import safe_yaml

# The most tokens, requests or leases a limit counts. Redis and Lua keep counts as
# doubles, which hold whole numbers exactly only up to 2^53: a bucket of 1e20 tokens
# never goes down by one. 10^15 leaves room for fractional refills.
MAX_COUNT = 10**15
# `${VAR}`, `${VAR:-default}`, or `$$` for a literal dollar sign.
_INTERPOLATION_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# The mistakes one error reports: enough for every typo in a hand-written file, few enough
# that the first ones stay on the screen when a wrong file (or a wrong indent) yields hundreds.
MAX_REPORTED = 20
# difflib's ratio a known key or value needs to be offered for a misspelling (difflib's own
# default): `brust`/`burst` score 0.8, `opn`/`open` 0.86, `retry`/`retries` 0.67, while
# `rate`/`mode` (0.25) or `port`/`url` (0.29) are no typo of each other.
SUGGESTION_CUTOFF = 0.6

_T = TypeVar("_T")
_P = ParamSpec("_P")


class ConfigError(Exception):
    """An invalid config file; str() is its lines shown to the user, one per mistake (most
    often one). Characters that are not printable (a key holding a newline, a value with a
    control character) are escaped as Python writes them, so each mistake stays one line
    and writes nothing to a terminal."""

    def __init__(self, message: str, *more: str) -> None:
        self.lines = tuple(_printable(line) for line in (message, *more))
        super().__init__("\n".join(self.lines))


class _Reader:
    """Walks the parsed document, remembering the YAML path for error messages.

    A mistake that leaves the rest readable (an unknown key, one bad limit or route) is
    noted in `errors` and reading goes on, so one run reports every mistake; `attempt`
    marks the parts that are read on past a failure. `raise_errors` ends the run with them.
    """

    def __init__(self, source: str, errors: list[str] | None = None) -> None:
        self.source = source
        self.errors: list[str] = [] if errors is None else errors
        self.broken: set[str] = set()  # the `attempt`ed parts that failed, by the name given
        # "SOURCE: PATH: " of each mapping with an unknown key: a failure of that mapping as a
        # whole (`expected exactly one of ...`) follows from the unknown key and is not reported.
        self._misspelt: set[str] = set()

    def within(self, source: str) -> _Reader:
        """A reader of another file (a tier key file, an rls_config file) whose mistakes are this one's."""
        reader = _Reader(source, self.errors)
        reader._misspelt = self._misspelt
        return reader

    def fail(self, path: str, message: str) -> NoReturn:
        raise ConfigError(self._line(path, message))

    def note(self, path: str, message: str) -> None:
        """A mistake that leaves the rest of the file readable: reported, and reading goes on."""
        self.errors.append(_printable(self._line(path, message)))

    def attempt(self, part: str, default: _T, parse: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """parse(*args, **kwargs), or `default` after noting its error and `part` as broken,
        so the parts after it are read too. Checks across parts skip a broken one: its
        `default` stands for nothing the file says."""
        try:
            return parse(*args, **kwargs)
        except ConfigError as exc:
            self.errors.extend(line for line in exc.lines if not line.startswith(tuple(self._misspelt)))
            self.broken.add(part)
            return default

    def raise_errors(self) -> None:
        """One ConfigError with every mistake noted, at most MAX_REPORTED of them; nothing if none."""
        if not self.errors:
            return
        shown = self.errors[:MAX_REPORTED]
        if len(self.errors) > MAX_REPORTED:
            shown.append(f"{self.source}: … and {len(self.errors) - MAX_REPORTED} more")
        raise ConfigError(*shown)

    def _line(self, path: str, message: str) -> str:
        where = f"{self.source}: {path}" if path else self.source
        return f"{where}: {message}"

    def mapping(
        self, value: Any, path: str, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
    ) -> Mapping[str, Any]:
        """`value`'s known keys. Unknown keys are noted, with the known key each may misspell,
        and left out. What then fails at this mapping's own path (`expected exactly one
        of ...`) or at a misspelt key's absent spelling (`required key is missing`) follows
        from the unknown key, and `attempt` does not report it."""
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {_type_name(value)}")
        known = required + optional
        unknown = [key for key in value if key not in known]
        for key in unknown:
            close = _closest(key, known) if isinstance(key, str) else None
            self.note(_join(path, str(key)), f"unknown key{_did_you_mean(close)} (expected one of: {', '.join(known)})")
            if close is not None and close not in value:
                self._misspelt.add(self._line(_join(path, close), ""))
        if unknown and path:  # a failure at the top level's own path is no consequence
            self._misspelt.add(self._line(path, ""))
        for key in required:
            if key not in value:
                self.fail(_join(path, key), "required key is missing")
        return {key: item for key, item in value.items() if key in known} if unknown else value

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
        # Noted, so that one run names every unset variable; the caller stops after interpolating.
        reader.note(path, f"environment variable {name} is not set and has no default (${{{name}:-default}})")
        return ""

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
        r.fail(path, f"expected {', '.join(others)} or {last}, got {value!r}{_suggestion(value, (*others, last))}")


def _suggestion(value: Any, known: Iterable[Any]) -> str:
    """`, did you mean `open`?` when `value` is a string close to one of `known`, else ""."""
    return _did_you_mean(_closest(value, known)) if isinstance(value, str) else ""


def _closest(word: str, known: Iterable[Any]) -> str | None:
    """The one of `known` (its strings) that `word` most likely misspells, if any is close."""
    matches = difflib.get_close_matches(word, [k for k in known if isinstance(k, str)], n=1, cutoff=SUGGESTION_CUTOFF)
    return matches[0] if matches else None


def _did_you_mean(close: str | None) -> str:
    return f", did you mean `{close}`?" if close is not None else ""


def _printable(line: str) -> str:
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


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
