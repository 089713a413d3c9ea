"""The reader of a response's cost (gateway/config/usage.py), as pure code: bytes in, a
count out, no I/O.

Fixed cases pin what each source reads and what says nothing, each read both ways a
JSON text is read: held and parsed (up to HELD_TEXT) and streamed through the scan
(gateway/config/json_scan.py). A generated-JSON property holds the scan to Python's json
(parse, then walk the path) at random chunk boundaries; SSE streams are split at every
byte; a 64 MB body and a 50 MB event are scanned under tracemalloc to show that what the
reader holds stays bounded. The reader's speed is measured by `python -m
tests.bench.usage_reader`, not here.
"""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.json_scan import ABSENT, MAX_COUNT, MAX_TOKEN, PathScan
from gateway.config.usage import HELD_TEXT, parse_usage_source

JSON = parse_usage_source("json:usage.total_tokens")
SSE = parse_usage_source("sse-json:usage.total_tokens")

OPENAI = json.dumps(
    {
        "id": "chatcmpl-123",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
    }
).encode()


def read(source, body: bytes, cuts: list[int] | None = None, headers=None) -> int | None:
    reader = source.reader(headers or {})
    start = 0
    for cut in [*(cuts or []), len(body)]:
        reader.feed(body[start:cut])
        start = cut
    return reader.result()


def bytewise(source, body: bytes) -> int | None:
    return read(source, body, list(range(1, len(body))))


def scanned(body: bytes, cuts: list[int] | None = None, source=JSON) -> int | None:
    """What the streaming scan alone finds, as the reader of a body past HELD_TEXT would."""
    scan = PathScan(source._keys)
    start = 0
    for cut in [*(cuts or []), len(body)]:
        scan.feed(body[start:cut])
        start = cut
    found = scan.outcome()
    return None if found == ABSENT else found


def every_way(body: bytes) -> set[int | None]:
    """The reader's answer whole and byte by byte, and the scan's, whole and byte by byte."""
    return {read(JSON, body), bytewise(JSON, body), scanned(body), scanned(body, list(range(1, len(body))))}


def reference(body: bytes, keys: list[str]) -> int | None:
    """What the path holds as Python's json reads the body, as a count or None."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if 0 <= value <= MAX_COUNT else None


# --- parsing the config string


@pytest.mark.parametrize(
    ("text", "shown", "reads_body"),
    [
        ("json:usage.total_tokens", "json:usage.total_tokens", True),
        ("sse-json:usage.total_tokens", "sse-json:usage.total_tokens", True),
        ("header:X-Usage-Units", "header:X-Usage-Units", False),
        ("response-bytes", "response-bytes", True),
        ("json:units", "json:units", True),
    ],
)
def test_a_source_is_parsed_and_shown_by_its_spelling(text, shown, reads_body):
    source = parse_usage_source(text)
    assert str(source) == shown
    assert source.reads_body is reads_body
    assert source == parse_usage_source(text)


@pytest.mark.parametrize(
    "text",
    [
        *["", "json", "json:", "json:usage.", "json:.usage", "json:a..b", "jsn:usage", "header:", "header:X Units"],
        *["response-bytes:x", "bytes", 7, "json:" + "k" * 257, "json:" + ".".join("k" * 33)],
    ],
)
def test_a_bad_spelling_is_one_line_saying_why(text):
    with pytest.raises(ValueError) as caught:
        parse_usage_source(text)
    assert "\n" not in str(caught.value) and str(caught.value)


# --- JSON bodies


def test_an_openai_body_says_its_total_whole_and_fed_one_byte_at_a_time():
    assert every_way(OPENAI) == {30}
    assert read(parse_usage_source("json:usage.prompt_tokens"), OPENAI) == 10


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # The path's words inside strings, arrays and other objects are not the path.
        (b'{"note": "\\"usage\\": {\\"total_tokens\\": 99}", "usage": {"total_tokens": 3}}', 3),
        (b'{"note": "usage", "total_tokens": 99}', None),
        (b'{"choices": [{"usage": {"total_tokens": 99}}], "usage": {"total_tokens": 4}}', 4),
        (b'{"choices": [{"usage": {"total_tokens": 99}}]}', None),
        (b'{"meta": {"usage": {"total_tokens": 99}}, "usage": {"total_tokens": 5}}', 5),
        (b'{"usage": {"inner": {"total_tokens": 99}, "total_tokens": 6}}', 6),
        (b'{"usage": {"inner": {"total_tokens": 99}}}', None),
        (b'[{"usage": {"total_tokens": 99}}]', None),
        (b'{"usage": [{"total_tokens": 99}]}', None),
        (b'{"a": "}]{[\\\\", "usage": {"b": "\\\\\\"}", "total_tokens": 7}}', 7),
        # Keys written with escapes are the keys they stand for.
        (b'{"us\\u0061ge": {"total_\\u0074okens": 8}}', 8),
        # Duplicate keys: the last one wins, at any level of the path.
        (b'{"usage": {"total_tokens": 1, "total_tokens": 9}}', 9),
        (b'{"usage": {"total_tokens": 1}, "usage": {"prompt_tokens": 2}}', None),
        (b'{"usage": {"total_tokens": 1}, "usage": null}', None),
        (b'{"usage": {"total_tokens": 1}, "usage": {"total_tokens": -1}}', None),
        (b'{"usage": null, "usage": {"total_tokens": 10}}', 10),
        (b'\r\n {"usage"\t:\n{ "total_tokens" :11 } }\n', 11),
        (b'{"usage": {"total_tokens": 12}, "after": [1, {"x": [[]]}, "s"]}', 12),
    ],
)
def test_only_the_path_itself_counts(body, expected):
    assert reference(body, ["usage", "total_tokens"]) == expected
    assert every_way(body) == {expected}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"0", 0),
        (b"30", 30),
        (b"-0", 0),
        (b"30.0", 30),
        (b"3e1", 30),
        (b"3.5E+1", 35),
        (str(MAX_COUNT).encode(), MAX_COUNT),
        (str(MAX_COUNT + 1).encode(), None),
        (b"1" * 30, None),
        (b"1e400", None),
        (b"-1", None),
        (b"30.5", None),
        (b"true", None),
        (b"false", None),
        (b"null", None),
        (b'"30"', None),
        (b"{}", None),
        (b"[30]", None),
    ],
)
def test_a_count_is_a_whole_number_from_zero_to_two_to_the_53(value, expected):
    body = b'{"usage": {"total_tokens": ' + value + b"}}"
    assert every_way(body) == {expected}


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{}",
        b'{"usage": {}}',
        b'{"usage": {"prompt_tokens": 10}}',
        b"[]",
        b"30",
        b'"usage"',
        # Malformed, or cut short, after the value was seen.
        b'{"usage": {"total_tokens": 30}',
        b'{"usage": {"total_tokens": 30}}}',
        b'{"usage": {"total_tokens": 30}} {}',
        b'{"usage": {"total_tokens": 30}, }',
        b'{"usage": {"total_tokens": 30} "x": 1}',
        b'{"usage": {"total_tokens": 30x}}',
        b'{"usage": {"total_tokens": 030}}',
        b'{"usage": {"total_tokens" 30}}',
        b'{"usage" {"total_tokens": 30}}',
        b'{"usage": {"total_tokens": 30}, "x": "open}',
        b'{"usage": {"total_tokens": 30}, "x": [1, 2}',
        b'{"usage": {"total_tokens": 30}, "x": tru}',
        b'{usage: {"total_tokens": 30}}',
        b'{"us\\qage": {"total_tokens": 30}}',
        b"\xef\xbb\xbf" + OPENAI,
        OPENAI[:-1],
        OPENAI + b"\x00",
    ],
)
def test_a_body_without_the_path_or_malformed_says_nothing(body):
    assert every_way(body) == {None}


def test_keys_and_numbers_past_the_token_bound_are_skipped_unread():
    long_key = b'{"' + b"k" * MAX_TOKEN + b'": 1, "usage": {"total_tokens": 30}}'
    long_number = b'{"x": ' + b"1" * MAX_TOKEN + b', "usage": {"total_tokens": 30}, "y": ' + b"2" * 2 * MAX_TOKEN + b"}"
    escaped_key = long_key[:5] + b'k\\\\\\"' + long_key[5:]
    for body in long_key, long_number, escaped_key:
        assert every_way(body) == {30}
        assert scanned(body, list(range(1000, len(body), 1000))) == 30
    target = b'{"usage": {"total_tokens": ' + b"3" * MAX_TOKEN + b"}}"
    assert scanned(target) is None
    assert scanned(target, list(range(1, len(target)))) is None
    # Off the path, much longer ones are skipped as well.
    off_path = b'{"x": {"' + b"k" * 10 * MAX_TOKEN + b'": ' + b"1" * 10 * MAX_TOKEN + b'}, "usage": {"total_tokens": 30}}'
    assert read(JSON, off_path) == 30
    assert scanned(off_path, [7, 100_000]) == 30


def test_a_body_past_the_held_bound_is_scanned_not_held():
    padding = json.dumps({"content": "x" * HELD_TEXT}).encode()
    body = b'{"a": ' + padding + b', "usage": {"total_tokens": 30}}'
    broken = b'{"a": ' + padding + b', "usage": {"total_tokens": 30}'
    for cuts in [], [HELD_TEXT - 1], list(range(1, len(body), 777)):
        assert read(JSON, body, cuts) == 30
        assert read(JSON, broken, [c for c in cuts if c < len(broken)]) is None


def test_deep_values_long_strings_and_escaped_keys_read_as_json_reads_them():
    # Nested deeper than the scan's regex reads in one match, string runs longer than it
    # matches (found with bytes.find), escapes between them; keys json is spared unless an
    # escape could spell them.
    run = "x" * 300
    deep = '[{"a": ' * 7 + '"' + run + '\\"' + run + "\\\\" + '"' + "}]" * 7
    text = '"' + ("\\n" + run) * 3 + '\\u0041"'
    body = ('{"d": ' + deep + ', "s": ' + text + ', "usage": {"total_tokens": 30}}').encode()
    assert reference(body, ["usage", "total_tokens"]) == 30
    assert every_way(body) == {30}
    assert every_way(body.replace(b'"total_tokens"', b'"total_tokens\\\\"')) == {None}
    slash = parse_usage_source("json:a/b")
    for spelled in b'{"a/b": 5}', b'{"a\\/b": 5}', b'{"\\u0061/b": 5}', b'{"a\\\\/b": 5, "x": "\\/"}':
        assert read(slash, spelled) == reference(spelled, ["a/b"])
        assert read(parse_usage_source("sse-json:a/b"), b"data: " + spelled + b"\n\n") == reference(spelled, ["a/b"])


def test_a_compressed_body_is_not_read():
    assert read(JSON, OPENAI, headers={"Content-Encoding": "gzip"}) is None
    assert read(JSON, OPENAI, headers={"Content-Encoding": "identity"}) == 30


# Generated JSON, with the path's keys frequent, duplicate keys, strings that spell the
# path, and whitespace everywhere JSON allows it, is read as Python's json reads it.
_KEYS = st.sampled_from(["usage", "total_tokens", "x", "usage ", "Usage", 'us"age'])
_SPACE = st.sampled_from(["", " ", "\n", "\r\n\t "])
_SCALARS = st.one_of(
    st.integers(min_value=-10, max_value=2**60).map(str),
    st.sampled_from(["30.0", "1.5", "1e3", "-0", "true", "false", "null", "2e400"]),
    st.text(alphabet='usage"\\{}[]:, é\n', max_size=12).map(lambda s: json.dumps(s, ensure_ascii=False)),
)


def _object(children):
    pairs = st.lists(st.tuples(_KEYS, children, _SPACE), max_size=4)
    return pairs.map(lambda items: "{" + ",".join(f"{s}{json.dumps(k)}{s}:{s}{v}" for k, v, s in items) + "}")


_VALUES = st.recursive(_SCALARS, lambda children: st.one_of(_object(children), st.lists(children, max_size=3).map(lambda v: "[" + ", ".join(v) + "]")), max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(text=_object(_VALUES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8), truncate=st.booleans())
def test_the_scan_agrees_with_pythons_json_at_any_chunk_boundaries(text, cuts, truncate):
    body = text.encode()
    if truncate:
        body = body[: len(body) // 2]
    expected = reference(body, ["usage", "total_tokens"])
    cuts = sorted(c for c in cuts if c <= len(body))
    assert read(JSON, body, cuts) == expected
    assert scanned(body, cuts) == expected
    whole_usage = parse_usage_source("json:usage")
    assert read(whole_usage, body) == scanned(body, cuts, whole_usage) == reference(body, ["usage"])


# --- server-sent events


def _chunk(usage: dict | None, content: str = "Hi") -> bytes:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}], "usage": usage}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


OPENAI_STREAM = (
    b"".join(_chunk(None, word) for word in ["Hel", "lo", ' "usage": {"total_tokens": 99}', "\n"])
    + _chunk({"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}, "")
    + b"data: [DONE]\n\n"
)


def test_an_openai_stream_says_the_usage_of_its_last_chunk_split_at_every_byte():
    assert read(SSE, OPENAI_STREAM) == 30
    for cut in range(1, len(OPENAI_STREAM)):
        assert read(SSE, OPENAI_STREAM, [cut]) == 30, cut
    assert bytewise(SSE, OPENAI_STREAM) == 30


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_any_line_ending_comments_fields_and_multiline_data(newline):
    lines = [
        b": keep-alive comment",
        b"event: message",
        b"id: 1",
        b"retry: 1000",
        b'data: {"usage":',
        b'data:{"total_tokens":',
        b"data",
        b"data: 42}}",
        b"",
        b":another comment",
        b"data: [DONE]",
        b"",
    ]
    body = newline.join(lines) + newline
    assert read(SSE, body) == 42
    assert bytewise(SSE, body) == 42
    rng = random.Random(newline)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(1, 12)))
        assert read(SSE, body, cuts) == 42


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # The last event that carries the path wins; events without it change nothing.
        (_chunk({"total_tokens": 5}) + _chunk({"total_tokens": 7}) + _chunk(None), 7),
        (_chunk({"total_tokens": 5}) + b"data: not json\n\n" + b"data: [DONE]\n\n", 5),
        # An event that carries a value that is no count leaves the stream without one.
        (_chunk({"total_tokens": 5}) + _chunk({"total_tokens": -5}), None),
        (_chunk(None) + b"data: [DONE]\n\n", None),
        (b"", None),
        # An event not ended by a blank line is dropped, as the standard says.
        (_chunk(None) + _chunk({"total_tokens": 5})[:-1], None),
        # A byte-order mark at the start is not part of the first line; `data:` without a space.
        (b"\xef\xbb\xbf" + _chunk({"total_tokens": 8}), 8),
        (b'data:{"usage":{"total_tokens":9}}\n\n', 9),
        # Fields other than data, and a data field with another name, are not data.
        (b'event: {"usage":{"total_tokens":9}}\n\n', None),
        (b'datum: {"usage":{"total_tokens":9}}\n\n', None),
        (b'data : {"usage":{"total_tokens":9}}\n\n', None),
        (b'data: {"usage":{"total_tokens":9}}\n: x\n\n', 9),
    ],
)
def test_which_event_says_the_count(body, expected):
    assert read(SSE, body) == expected
    assert bytewise(SSE, body) == expected


def test_an_event_past_the_held_bound_is_scanned_not_held():
    long = _chunk({"total_tokens": 5}, "x" * 3 * HELD_TEXT)
    body = _chunk({"total_tokens": 4}) + long + _chunk(None, "y" * 3 * HELD_TEXT) + b"data: [DONE]\n\n"
    assert read(SSE, body) == 5
    assert read(SSE, body, list(range(1, len(body), 1000))) == 5
    assert read(SSE, body + long.replace(b"5}", b"-5}")) is None


# --- headers and bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [("250", 250), (" 250\t", 250), ("0", 0), (str(MAX_COUNT), MAX_COUNT), (str(MAX_COUNT + 1), None)]
    + [(bad, None) for bad in ["", "-1", "2.5", "1e3", "25 0", "1,2", "²", "0x10", "abc", None]],
)
def test_a_header_says_a_whole_number(value, expected):
    source = parse_usage_source("header:X-Usage-Units")
    headers = {} if value is None else {"x-usage-units": value}
    reader = source.reader(headers)
    reader.feed(b"ignored")
    assert reader.result() == expected
    assert source.reader(lambda name: value if name == "X-Usage-Units" else None).result() == expected


def test_response_bytes_counts_what_was_fed():
    source = parse_usage_source("response-bytes")
    assert read(source, b"") == 0
    assert read(source, OPENAI, list(range(1, len(OPENAI), 7))) == len(OPENAI)
    assert read(source, OPENAI, headers={"Content-Encoding": "gzip"}) == len(OPENAI)


# --- bounded memory and speed

CHUNK = 64 * 1024


def _stream(head: bytes, unit: bytes, units: int, tail: bytes) -> Iterator[bytes]:
    """head + unit * units + tail in CHUNK-byte pieces, cut anywhere, never held whole."""
    total = len(head) + len(unit) * units + len(tail)
    body_end = total - len(tail)
    repeated = unit * (CHUNK // len(unit) + 2)
    position = 0
    while position < total:
        stop = min(position + CHUNK, total)
        parts = [head[position:stop]] if position < len(head) else []
        at = max(position, len(head))
        if at < min(stop, body_end):
            start = (at - len(head)) % len(unit)
            parts.append(repeated[start : start + min(stop, body_end) - at])
        if stop > body_end:
            parts.append(tail[max(position, body_end) - body_end : stop - body_end])
        yield b"".join(parts)
        position = stop


FILLER = json.dumps(
    {"index": 0, "message": {"role": "assistant", "content": 'a "usage": {"total_tokens": 1} \\ } ] ' * 20}, "logprobs": [0.1, -2.5, [], {}]}
).encode()


def _filler_body(megabytes: int) -> tuple[Iterator[bytes], int]:
    units = megabytes * 1024 * 1024 // (len(FILLER) + 1)
    head = b'{"id": "chatcmpl-big", "choices": ['
    tail = b'{}], "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}}'
    return _stream(head, FILLER + b",", units, tail), len(head) + units * (len(FILLER) + 1) + len(tail)


def test_the_stream_helper_cuts_the_body_it_describes():
    chunks, size = _filler_body(1)
    body = b"".join(chunks)
    assert len(body) == size
    assert reference(body, ["usage", "total_tokens"]) == 30


def test_a_64_mb_body_is_scanned_in_bounded_memory_and_its_usage_found():
    chunks, size = _filler_body(64)
    reader = JSON.reader({})
    tracemalloc.start()
    try:
        for chunk in chunks:
            reader.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 64_000_000  # 64 times the bound below
    assert reader.result() == 30
    assert peak < 1024 * 1024, peak


def test_an_sse_stream_with_one_huge_event_is_scanned_in_bounded_memory():
    head = b': opening comment\n\ndata: {"choices": ['
    tail = b'{}], "usage": {"total_tokens": 30}}\n\ndata: [DONE]\n\n'
    units = 50 * 1024 * 1024 // (len(FILLER) + 1)
    reader = SSE.reader({})
    tracemalloc.start()
    try:
        for chunk in _stream(head, FILLER + b",", units, tail):
            reader.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reader.result() == 30
    assert peak < 1024 * 1024, peak


def _throughput(source, body: bytes) -> float:
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        reader = source.reader({})
        for chunk in chunks:
            reader.feed(chunk)
        best = min(best, time.perf_counter() - started)
        assert reader.result() == 30
    return len(body) / best / 1e6
