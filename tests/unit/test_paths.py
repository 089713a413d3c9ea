"""The path rule as plain functions (gateway.proxy.paths): no sockets, no gateway.

`normalize_path(raw, setting)` gives the path forwarded, the path matched and
whether `;` parameters were present, or raises PathRejected. The properties at
the end hold for any raw path Hypothesis can build from the characters that
matter here."""

from __future__ import annotations

import contextlib
import re
import string
from urllib.parse import unquote

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.config.model import DotSegments, EscapedSlashes, PathNormalization
from gateway.proxy.paths import PathRejected, normalize_path

DEFAULT = PathNormalization()
DOTS_REJECT = PathNormalization(dot_segments=DotSegments.REJECT)
SLASHES_REJECT = PathNormalization(escaped_slashes=EscapedSlashes.REJECT)
SLASHES_DECODE = PathNormalization(escaped_slashes=EscapedSlashes.DECODE)
KEEP_EMPTY = PathNormalization(merge_slashes=False)
EVERY_SETTING = [
    PathNormalization(dot_segments=dots, escaped_slashes=slashes, merge_slashes=merge)
    for dots in DotSegments
    for slashes in EscapedSlashes
    for merge in (True, False)
]


def read(raw: str, setting: PathNormalization = DEFAULT) -> tuple[str, str, bool] | str:
    """(forward, match, parameters), or "400" when the rule refuses the path."""
    try:
        return tuple(normalize_path(raw, setting))
    except PathRejected:
        return "400"


@pytest.mark.parametrize(
    ("raw", "forward", "match"),
    [
        ("/", "/", "/"),
        ("/api/reports", "/api/reports", "/api/reports"),
        ("/api/reports/", "/api/reports/", "/api/reports/"),
        ("/static/app.v2.js", "/static/app.v2.js", "/static/app.v2.js"),
        ("/.well-known/x", "/.well-known/x", "/.well-known/x"),
        ("/api/..reports/x...", "/api/..reports/x...", "/api/..reports/x..."),
        ("/x/../api/reports", "/api/reports", "/api/reports"),
        ("/api/./reports", "/api/reports", "/api/reports"),
        ("//api///reports", "/api/reports", "/api/reports"),
        ("/../../api/reports", "/api/reports", "/api/reports"),
        ("/api/reports/x/..", "/api/reports/", "/api/reports/"),
        ("/api/reports/.", "/api/reports/", "/api/reports/"),
        ("/a/b/../../..", "/", "/"),
        ("/..", "/", "/"),
        ("/api/%2e%2e/x", "/x", "/x"),
        ("/api/%2E%2e/x", "/x", "/x"),
        ("/api/.%2e/x", "/x", "/x"),
        ("/api/%2e/x", "/api/x", "/api/x"),
        ("/%61pi/x", "/api/x", "/api/x"),
        ("/api/caf%c3%a9", "/api/caf%C3%A9", "/api/café"),
        ("/api/my%20report", "/api/my%20report", "/api/my report"),
        ("/api/group%2fproject", "/api/group%2Fproject", "/api/group%2Fproject"),
        ("/api/a%3Bb", "/api/a%3Bb", "/api/a;b"),
        ("/api/100%25", "/api/100%25", "/api/100%"),
        ("/api/%252e%252e/x", "/api/%252e%252e/x", "/api/%2e%2e/x"),  # decoded once, never twice
        ("/API/X", "/API/X", "/API/X"),
    ],
)
def test_the_default_setting(raw, forward, match):
    assert read(raw) == (forward, match, False)


@pytest.mark.parametrize(
    ("raw", "forward", "match"),
    [
        ("/api;x/y", "/api;x/y", "/api/y"),
        ("/public/..;/api/x", "/api/x", "/api/x"),
        ("/api/reports;x", "/api/reports;x", "/api/reports"),
        ("/api;/y", "/api;/y", "/api/y"),
        ("/;x/api", "/api", "/api"),  # an empty segment goes with its parameters
        ("/api/x;a=%2e%2E;b", "/api/x;a=..;b", "/api/x"),
        ("/api/%2e%2e;x/y", "/y", "/y"),
    ],
)
def test_parameters_are_left_out_of_the_match_and_flagged(raw, forward, match):
    assert read(raw) == (forward, match, True)


@pytest.mark.parametrize(
    "raw",
    [
        "/api%20/x",
        "/%20api",
        "/api/x%20",
        "/api%09/x",
        "/api/%00",
        "/api/x%0A",
        "/api/%7f",
        "/api/x;a=%00",
        "/api/%zz",
        "/api/%2",
        "/api/%",
        "/api/%ff",
        "/api/%c0%ae%c0%ae/x",  # overlong "..", which some decoders accept
        "/api/%e2%82",
        "/api\\..\\x",
        "/api/a#b",
        "/api/a b",
        "/api/caf\u00e9",
        "/api/{id}",
        "/api/a|b",
        "/public/..%2Fapi",
        "/public/x%2F..",
        "/public/.%2Fapi",
        "/public/..%5Capi",
        "/public/x%5C%2e%2e",
        "api/x",
        "",
    ],
)
def test_paths_refused_in_the_default_setting(raw):
    assert read(raw) == "400"


def test_dot_segments_reject():
    for raw in ("/api/../x", "/api/%2e%2e/x", "/api/./x", "/api/x/.", "/public/..;/api/x", "/..", "/api/%2E"):
        assert read(raw, DOTS_REJECT) == "400", raw
    assert read("/api/..x/.y", DOTS_REJECT) == ("/api/..x/.y", "/api/..x/.y", False)


def test_escaped_slashes_reject_and_decode():
    assert read("/api/group%2Fproject", SLASHES_REJECT) == "400"
    assert read("/api/group%2fproject", SLASHES_REJECT) == "400"
    assert read("/api/group%252Fproject", SLASHES_REJECT) == ("/api/group%252Fproject", "/api/group%2Fproject", False)
    assert read("/api/group%2Fproject", SLASHES_DECODE) == ("/api/group/project",) * 2 + (False,)
    assert read("/api%2Freports", SLASHES_DECODE) == ("/api/reports", "/api/reports", False)
    assert read("/public/..%2Fapi/x", SLASHES_DECODE) == ("/api/x", "/api/x", False)
    assert read("/public/..%5Capi/x", SLASHES_DECODE) == "400"
    assert read("/api%2F%2Fx", SLASHES_DECODE) == ("/api/x", "/api/x", False)


def test_merge_slashes_off_keeps_empty_segments_as_they_are():
    assert read("//api//x", KEEP_EMPTY) == ("//api//x", "//api//x", False)
    assert read("/api//x/", KEEP_EMPTY) == ("/api//x/", "/api//x/", False)
    assert read("/a//..", KEEP_EMPTY) == ("/a/", "/a/", False)
    assert read("/a/./b", KEEP_EMPTY) == ("/a/b", "/a/b", False)
    assert read("/;x/api", KEEP_EMPTY) == ("/;x/api", "//api", True)


@pytest.mark.parametrize("setting", EVERY_SETTING, ids=str)
@pytest.mark.parametrize("raw", ["/api%20/x", "/api/%00", "/api/%zz", "/api/%ff", "/api\\x", "/public/..%5Capi"])
def test_what_every_setting_refuses(raw, setting):
    assert read(raw, setting) == "400"


@pytest.mark.parametrize("setting", EVERY_SETTING, ids=str)
@pytest.mark.parametrize("raw", ["/", "/api/reports", "/api/reports/", "/static/app.v2.js", "/a-b_c~d/!$&'()*+,=:@"])
def test_a_plain_path_is_left_alone_by_every_setting(raw, setting):
    assert read(raw, setting) == (raw, raw, False)


# --- properties ---------------------------------------------------------------------

# The characters that change how a path is read, and a few that do not.
PIECES = ["/", ".", "..", "%2e", "%2E", "%2f", "%2F", "%5c", ";", "%3b", "%25", "%20", "%00", "%c3%a9", "%ff", "%",
          "a", "A", "api", "x", "=", "~", "\\", "#", " ", "é", "-", "%41"]
# Up to 12 pieces, drawn as one string of stand-in letters (one per piece) that becomes the
# path: a single draw for Hypothesis, where a list of sampled pieces took two per piece.
_STAND_INS = string.ascii_letters[: len(PIECES)]
_AS_PIECE = {ord(letter): piece for letter, piece in zip(_STAND_INS, PIECES, strict=True)}
raw_paths = st.text(_STAND_INS, max_size=12).map(lambda letters: "/" + letters.translate(_AS_PIECE))
setting_of = st.sampled_from(EVERY_SETTING)


@settings(max_examples=2000, deadline=None)
@given(raw_paths, setting_of)
@example("/public/..;/api/x", DEFAULT)
@example("/api/%2e%2e/x", DEFAULT)
def test_the_forwarded_path_reads_back_as_itself_and_the_same_match(raw, setting):
    """Whatever the gateway forwards, read again by the same rule, is forwarded unchanged
    and matched the same way: an upstream that sees it sees exactly what was matched."""
    try:
        first = normalize_path(raw, setting)
    except PathRejected:
        return
    again = normalize_path(first.forward, setting)
    assert again.forward == first.forward
    assert again.match == first.match
    assert again.parameters <= first.parameters  # parameters of a resolved dot segment go with it


@settings(max_examples=2000, deadline=None)
@given(raw_paths, setting_of)
def test_the_match_is_the_forwarded_path_decoded(raw, setting):
    """Decoding the forwarded path segment by segment (parameters left out, an encoded
    slash left as %2F with `keep`) gives the match: the two views cannot disagree."""
    try:
        path = normalize_path(raw, setting)
    except PathRejected:
        return
    names = [unquote(s.partition(";")[0].replace("%2F", "%252F")) for s in path.forward.split("/")]
    assert "/".join(names) == path.match
    assert ".." not in names and "." not in names
    if setting.merge_slashes:
        assert "//" not in path.forward
    # Canonical: no escaped unreserved character, and upper-case hex.
    assert not re.search(r"%(2[eE]|[46][1-9a-fA-F]|[57][0-9aA]|3[0-9]|5[fF]|7[eE]|2[dD])", path.forward)
    assert not re.search(r"%(?![0-9A-F]{2})", path.forward)


@settings(max_examples=1000, deadline=None)
@given(st.text(st.characters(exclude_categories=()), max_size=40).map(lambda text: "/" + text), setting_of)
def test_any_text_is_read_or_refused_never_an_other_error(raw, setting):
    # Surrogates included: aiohttp hands over bytes that are not UTF-8 as lone surrogates.
    with contextlib.suppress(PathRejected):
        normalize_path(raw, setting)
