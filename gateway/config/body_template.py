"""The body template of a limit's rejections (`response.body`), and its content type.

The syntax is small on purpose: literal text with the placeholders `{limit}`
(the name of the limit that denied) and `{retry_after}` (whole seconds, as in
Retry-After); `{{` and `}}` stand for braces. Nothing else is read inside braces,
so a template can never reach an attribute, an index or a format spec, and
anything else in braces is a config error. Both values are safe anywhere in
JSON, HTML or plain text: limit names are letters, digits, `_`, `-` and `.`,
and the seconds are digits. Trusts nothing in the template beyond this syntax.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PLACEHOLDERS = ("limit", "retry_after")
_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
# type/subtype and `; name=value` parameters (a value a token or a quoted string), per RFC 9110 §8.3.1.
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_CONTENT_TYPE_RE = re.compile(rf'{_TOKEN}/{_TOKEN}(?:[ \t]*;[ \t]*{_TOKEN}=(?:{_TOKEN}|"[^"\\\x00-\x1f\x7f]*"))*')


@dataclass(frozen=True, slots=True)
class BodyTemplate:
    text: str
    # Literal text and placeholder names alternate: parts[0], parts[2], ... are literal.
    parts: tuple[str, ...]

    def chunks(self, limit: str) -> tuple[bytes, ...]:
        """The body for `limit`, split where the seconds to wait go: join the chunks with them."""
        chunks, current = [], ""
        for i, part in enumerate(self.parts):
            if i % 2 == 0:
                current += part
            elif part == "limit":
                current += limit
            else:
                chunks.append(current.encode())
                current = ""
        chunks.append(current.encode())
        return tuple(chunks)


def parse_body_template(text: object) -> BodyTemplate:
    """A template from the config. Raises ValueError, naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError("expected a string")
    parts, literal, end = [], "", 0
    for match in _TOKEN_RE.finditer(text):
        literal += text[end : match.start()]
        end = match.end()
        token = match.group(0)
        if token in ("{{", "}}"):
            literal += token[0]
        elif match.group(1) in PLACEHOLDERS:
            parts += [literal, match.group(1)]
            literal = ""
        elif match.group(1) is not None:
            raise ValueError(f"unknown placeholder {token!r} (expected {{limit}} or {{retry_after}}; write {{{{ and }}}} for braces)")
        else:
            raise ValueError(f"a lone {token!r} at offset {match.start()} (write {token * 2} for a brace)")
    parts.append(literal + text[end:])
    return BodyTemplate(text=text, parts=tuple(parts))


def parse_content_type(text: object) -> str:
    """A media type with optional parameters, such as `application/json; charset=utf-8`."""
    if not isinstance(text, str) or not _CONTENT_TYPE_RE.fullmatch(text):
        raise ValueError(f"expected a media type such as application/json; charset=utf-8, got {text!r}")
    return text
