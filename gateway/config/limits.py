"""The `limits` section: rate limits, quotas and concurrency limits, their identity
sources (`key`), tiers and their key files, allowlists, and the rejection `response`.

Trusts nothing in the file or in a tier key file: every name, count and source is
checked, and a header the gateway writes itself can name no client.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
from collections.abc import Mapping
from typing import Any

import yaml

from gateway.config import safe_yaml
from gateway.config.body_template import parse_body_template, parse_content_type
from gateway.config.http_names import FORWARDING, HOP_BY_HOP, HTTP_TOKEN_RE
from gateway.config.model import (
    DEFAULT_BODY_CONTENT_TYPE,
    DEFAULT_LEASE_LAPSE,
    Allowlist,
    ConcurrencyLimit,
    FailurePolicy,
    HeaderStyle,
    IdentitySource,
    Limit,
    Quota,
    ResponseStyle,
    Tiers,
)
from gateway.config.reader import MAX_COUNT, _choice, _join, _Reader, _suggestion, _type_name
from gateway.config.response_cost import parse_response_cost
from gateway.config.units import Rate, parse_duration, parse_rate, parse_time_of_day

# A concurrency lease outlives a gateway that died holding it by at most this. Leases of
# requests that last longer are renewed every third of it, so it only bounds that wait.
DEFAULT_LEASE_TTL = "60s"
# Renewals come every third of the TTL; below a second they would be most of the traffic.
MIN_LEASE_TTL = 1.0
# A rejection says "too many requests" (429), or, for clients that retry only on it, "unavailable" (503).
REJECTION_STATUSES = (429, 503)
# The longest `max_delay`: a wait past it is better told to the client as Retry-After
# than held on an open connection.
MAX_MAX_DELAY = 60.0
# A quota's window lengths; a month's is nominal (its windows follow the calendar).
QUOTA_PERIODS = {"hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0, "month": 30 * 86400.0}
IDENTITY_KINDS = ("header", "query", "cookie", "jwt")
# Sources that name no client but the request: the matched route's configured path (bounded
# by the config, unlike the request path, which a client could vary to mint buckets), the
# Host as routes match it, and the method (unregistered ones read as OTHER).
REQUEST_SOURCES = ("path", "host", "method")
# Headers an identity may not be read from: hop-by-hop fields never reach the upstream, and
# the forwarding headers are the gateway's to write (`ip` with trusted_proxies reads them).
UNKEYABLE_HEADERS = HOP_BY_HOP | FORWARDING
# Hex digits in either case, as sha256sum (lower) and PowerShell's Get-FileHash (upper) print them.
_SHA256_RE = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_LIMIT_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _limit(name: Any, doc: Any, path: str, response: ResponseStyle, trusted: tuple[Any, ...], r: _Reader) -> Limit:
    """`response`: the top-level `response`, which the limit's own overrides key by key."""
    if not isinstance(name, str) or not _LIMIT_NAME_RE.match(name):
        r.fail(path, "limit names may use letters, digits, '_', '-' and '.' only")
    spec = r.mapping(
        doc,
        path,
        optional=(
            "rate", "burst", "quota", "key", "on_store_error", "shadow", "mode", "max_delay", "response", "lease",
            "lease_lapse", "tiers", "allow", "cost",
        ),
    )
    if ("rate" in spec) == ("quota" in spec):
        r.fail(path, "expected exactly one of `rate` (a token bucket) and `quota` (a fixed window)")
    quota = None
    if "quota" in spec:
        if "burst" in spec:
            r.fail(f"{path}.burst", "a quota has no burst: its limit is what one window admits")
        quota = _quota(spec["quota"], f"{path}.quota", r)
        rate = Rate(tokens=quota.limit, period_seconds=QUOTA_PERIODS[quota.per], text=f"{quota.limit}/{quota.per}")
        burst = quota.limit
    else:
        rate, burst = _rate_and_burst(spec, path, r)
    max_delay = _max_delay(spec, path, r)
    if max_delay and quota is not None:
        r.fail(f"{path}.mode", "a quota cannot delay: its window refills only when it ends")
    if max_delay and spec.get("shadow") is True:
        r.fail(f"{path}.mode", "a shadow limit never holds a request back, so it cannot delay one")
    sources = _key(spec, path, r)
    policy = _choice(FailurePolicy, spec.get("on_store_error", FailurePolicy.OPEN.value), f"{path}.on_store_error", r)
    shadow = r.boolean(spec.get("shadow", False), f"{path}.shadow")
    if "response" in spec:
        response = _response(spec["response"], f"{path}.response", response, r)
    lease = r.count(spec["lease"], f"{path}.lease") if "lease" in spec else 0
    if lease > burst:
        r.fail(f"{path}.lease", f"a lease of {lease} is more than the burst {burst}, which is all a bucket ever holds")
    if "lease_lapse" in spec and not lease:
        r.fail(f"{path}.lease_lapse", "applies to a `lease`, which this limit does not have")
    lease_lapse = DEFAULT_LEASE_LAPSE
    if "lease_lapse" in spec:
        lease_lapse = r.parsed(parse_duration, spec["lease_lapse"], f"{path}.lease_lapse")
    if lease and (quota is not None or max_delay):
        r.fail(f"{path}.lease", "a lease takes tokens of a token bucket that rejects; a quota or a delaying limit has none to lease")
    cost = None
    if "cost" in spec:
        cost = parse_response_cost(spec["cost"], f"{path}.cost", burst, r)
        if quota is not None:
            r.fail(f"{path}.cost", "a cost settled after the response needs a `rate`: a quota's window may end before it is settled")
        if max_delay:
            r.fail(f"{path}.cost", "a cost settled after the response may put the bucket into debt, which a delaying limit spends on waits")
        if lease:
            r.fail(f"{path}.cost", "a leased limit spends its tokens in this process, where a settlement after the response cannot reach")
    limit = Limit(
        name=name,
        rate=rate,
        burst=burst,
        key=sources,
        on_store_error=policy,
        shadow=shadow,
        response=response,
        lease=lease,
        lease_lapse=lease_lapse,
        max_delay=max_delay,
        quota=quota,
        cost=cost,
    )
    if "allow" in spec:
        limit = dataclasses.replace(limit, allow=_allow(spec["allow"], f"{path}.allow", sources, r))
    if "tiers" in spec:
        if lease or quota is not None:
            r.fail(f"{path}.tiers", "tiers give buckets their own rate and burst; not with a quota or a lease")
        limit = dataclasses.replace(limit, tiers=_tiers(spec["tiers"], f"{path}.tiers", limit, trusted, r))
    return limit


def _response(doc: Any, path: str, inherited: ResponseStyle, r: _Reader) -> ResponseStyle:
    """A `response` block: each key given replaces the one `inherited`. `body` and
    `content_type` go together: a block that sets `body` gets its own content type."""
    spec = r.mapping(doc, path, optional=("status", "headers", "body", "content_type"))
    status = inherited.status
    if "status" in spec:
        status = r.integer(spec["status"], f"{path}.status", minimum=0)
        if status not in REJECTION_STATUSES:
            r.fail(f"{path}.status", f"expected 429 or 503, got {status}")
    headers = _choice(HeaderStyle, spec["headers"], f"{path}.headers", r) if "headers" in spec else inherited.headers
    if "content_type" in spec and "body" not in spec:
        r.fail(f"{path}.content_type", "sets the type of `body`, which this block does not set")
    body, content_type = inherited.body, inherited.content_type
    if "body" in spec:
        body = r.parsed(parse_body_template, spec["body"], f"{path}.body")
        content_type = r.parsed(parse_content_type, spec.get("content_type", DEFAULT_BODY_CONTENT_TYPE), f"{path}.content_type")
    return ResponseStyle(status=status, headers=headers, body=body, content_type=content_type)


def _concurrency_limit(name: Any, doc: Any, path: str, r: _Reader) -> ConcurrencyLimit:
    """A limit with `concurrency: N` is its own kind: it counts requests in flight, not a rate."""
    if not isinstance(name, str) or not _LIMIT_NAME_RE.match(name):
        r.fail(path, "limit names may use letters, digits, '_', '-' and '.' only")
    for key in ("rate", "burst", "shadow"):
        if key in doc:
            r.fail(
                _join(path, key),
                f"a concurrency limit takes no {key}; define a rate limit of its own and list both on the route",
            )
    spec = r.mapping(doc, path, required=("concurrency",), optional=("lease_ttl", "key", "on_store_error"))
    lease_ttl = r.parsed(parse_duration, spec.get("lease_ttl", DEFAULT_LEASE_TTL), f"{path}.lease_ttl")
    if lease_ttl < MIN_LEASE_TTL:
        r.fail(f"{path}.lease_ttl", f"expected at least {MIN_LEASE_TTL:g}s, got {spec['lease_ttl']!r}")
    sources = _key(spec, path, r)
    policy = _choice(FailurePolicy, spec.get("on_store_error", FailurePolicy.OPEN.value), f"{path}.on_store_error", r)
    return ConcurrencyLimit(
        name=name,
        concurrency=r.count(spec["concurrency"], f"{path}.concurrency"),
        lease_ttl=lease_ttl,
        key=sources,
        on_store_error=policy,
    )


def _max_delay(spec: Mapping[str, Any], path: str, r: _Reader) -> float:
    """`mode: delay` with `max_delay`: the longest wait; 0 for `mode: reject` (the default)."""
    mode = spec.get("mode", "reject")
    if mode not in ("reject", "delay"):
        r.fail(f"{path}.mode", f"expected reject or delay, got {mode!r}{_suggestion(mode, ('reject', 'delay'))}")
    if mode == "reject":
        if "max_delay" in spec:
            r.fail(f"{path}.max_delay", "only applies with mode: delay")
        return 0.0
    if "max_delay" not in spec:
        r.fail(f"{path}.max_delay", "required with mode: delay (the longest a request waits, such as 500ms)")
    max_delay = r.parsed(parse_duration, spec["max_delay"], f"{path}.max_delay")
    if max_delay > MAX_MAX_DELAY:
        r.fail(f"{path}.max_delay", f"at most {MAX_MAX_DELAY:g}s: a longer wait is better told as Retry-After")
    return max_delay


def _quota(doc: Any, path: str, r: _Reader) -> Quota:
    spec = r.mapping(doc, path, required=("limit", "per"), optional=("reset",))
    per = spec["per"]
    if per not in QUOTA_PERIODS:
        r.fail(f"{path}.per", f"expected {', '.join(QUOTA_PERIODS)}, got {per!r}{_suggestion(per, QUOTA_PERIODS)}")
    return Quota(
        limit=r.count(spec["limit"], f"{path}.limit"),
        per=per,
        reset=r.parsed(parse_time_of_day, spec.get("reset", "00:00 UTC"), f"{path}.reset"),
    )


def _key(spec: Mapping[str, Any], path: str, r: _Reader) -> tuple[IdentitySource, ...]:
    """A limit's `key`: its sources in order, the first present wins."""
    keys = spec.get("key", ["ip"])
    if isinstance(keys, str):
        keys = [keys]
    # `key: []`: no source at all, so every client shares the one bucket.
    items = r.sequence(keys, f"{path}.key") or ["global"]
    sources = tuple(_identity(item, f"{path}.key[{i}]", r) for i, item in enumerate(items))
    for i, source in enumerate(sources):
        if source in sources[:i]:
            r.fail(f"{path}.key[{i}]", f"{source} is listed twice")
        if i and sources[i - 1].always_present:
            r.fail(f"{path}.key[{i}]", f"never read: every request has {sources[i - 1]}, listed before it")
    return sources


def _rate_and_burst(spec: Mapping[str, Any], path: str, r: _Reader) -> tuple[Any, int]:
    rate = r.parsed(parse_rate, spec["rate"], f"{path}.rate")
    if "burst" in spec:
        return rate, r.count(spec["burst"], f"{path}.burst")
    if rate.tokens != int(rate.tokens) or rate.tokens < 1:
        r.fail(f"{path}.burst", f"required when the rate's count is not a whole number ({rate.text})")
    if rate.tokens > MAX_COUNT:
        r.fail(f"{path}.rate", f"a burst of {rate.tokens:g} is more than the {MAX_COUNT:,} a limit counts exactly")
    return rate, int(rate.tokens)


def _identity(value: Any, path: str, r: _Reader) -> IdentitySource:
    """One entry of a limit's `key`: a source, or a list of sources that together name a bucket."""
    if not isinstance(value, list):
        return _single_source(value, path, r)
    parts = tuple(_single_source(item, f"{path}[{i}]", r) for i, item in enumerate(value))
    if len(parts) < 2:
        r.fail(path, "a composite key entry lists two sources or more (one source needs no list)")
    for i, part in enumerate(parts):
        if part.kind == "global":
            r.fail(f"{path}[{i}]", "global names no client; it cannot be part of a composite key")
        if part in parts[:i]:
            r.fail(f"{path}[{i}]", f"{part} is listed twice")
    return IdentitySource(kind="composite", parts=parts)


def _single_source(value: Any, path: str, r: _Reader) -> IdentitySource:
    expected = (
        "expected ip, ip/PREFIX, ip/PREFIX4,PREFIX6, header:NAME, query:NAME, cookie:NAME, jwt:CLAIM, "
        "path, host, method or global"
    )
    if isinstance(value, int) and not isinstance(value, bool):
        r.fail(path, f"{expected}, got an integer (in a [...] list, quote 'ip/24,64': YAML splits it at the comma)")
    if not isinstance(value, str):
        r.fail(path, f"{expected}, got {_type_name(value)}")
    if value == "ip" or value.startswith("ip/"):
        return _ip_source(value, path, r)
    if value in REQUEST_SOURCES or value == "global":
        return IdentitySource(kind=value)
    kind, sep, name = value.partition(":")
    if not sep or kind not in IDENTITY_KINDS or not name:
        r.fail(path, f"{expected}, got {value!r}")
    if kind == "header":
        if not HTTP_TOKEN_RE.match(name):
            r.fail(path, f"{name!r} is not a valid header name")
        name = name.lower()
        if name in UNKEYABLE_HEADERS:
            r.fail(path, f"{name} is not forwarded as the client sent it, so it cannot be an identity (use ip with trusted_proxies)")
    if kind == "jwt" and not HTTP_TOKEN_RE.match(name):
        r.fail(path, f"{name!r} is not a claim name")
    return IdentitySource(kind=kind, name=name)


def _ip_source(value: str, path: str, r: _Reader) -> IdentitySource:
    """`ip`, `ip/V4` (IPv4 clients grouped by their /V4 network, IPv6 ones by address) or
    `ip/V4,V6` (IPv6 clients by their /V6 network too)."""
    if value == "ip":
        return IdentitySource(kind="ip")
    v4_text, comma, v6_text = value[3:].partition(",")
    prefixes = []
    for text, family, bits in ((v4_text, "IPv4", 32), (v6_text if comma else "128", "IPv6", 128)):
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= bits:
            r.fail(path, f"expected ip/PREFIX4 or ip/PREFIX4,PREFIX6 with an {family} prefix from 1 to {bits}, got {value!r}")
        prefixes.append(int(text))
    return IdentitySource(kind="ip", ipv4_prefix=prefixes[0], ipv6_prefix=prefixes[1])


def _allow(doc: Any, path: str, sources: tuple[IdentitySource, ...], r: _Reader) -> Allowlist:
    """`allow: [CIDR or address, SOURCE=VALUE, ...]`: an address is matched against the client's
    (as `ip` reads it), an identity against what the limit's key read."""
    networks = []
    identities = set()
    readable = {str(source): source for source in sources}
    for i, item in enumerate(r.sequence(doc, path)):
        where = f"{path}[{i}]"
        text = r.string(item, where)
        source_text, equals, value = text.partition("=")
        if not equals:
            try:
                networks.append(_network(text))
            except ValueError as exc:
                r.fail(where, f"{exc}; or SOURCE=VALUE for an identity")
            continue
        source = _single_source(source_text, where, r)
        if str(source) not in readable or source.kind == "global":
            keyed = ", ".join(readable)
            r.fail(where, f"this limit's key never reads {source} (it reads {keyed}); an address needs no `ip=`")
        if not value:
            r.fail(where, f"expected {source_text}=VALUE, got {text!r}")
        identities.add(f"{source}={value}")
    if not networks and not identities:
        r.fail(path, "expected at least one address, network or SOURCE=VALUE")
    return Allowlist(networks=tuple(networks), identities=frozenset(identities))


def _network(text: str) -> Any:
    """An address or a network. `10.0.0.1/8` is refused, not read as 10.0.0.0/8: it may
    have meant the one host, and would name sixteen million."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "host bits set" in str(exc):
            raise ValueError(f"{text!r} has host bits set; write the network, as in {ipaddress.ip_network(text, strict=False)}") from None
        raise ValueError(f"expected an address or a network such as 10.0.0.0/8, got {text!r}") from None


def _tiers(doc: Any, path: str, base: Limit, trusted: tuple[Any, ...], r: _Reader) -> Tiers:
    """`tiers: {from: {file: F} or {header: H}, TIER: {rate, burst}, ...}`; the limit's own rate
    and burst are the default tier's."""
    if not isinstance(doc, dict):
        r.fail(path, f"expected a mapping, got {_type_name(doc)}")
    spec = r.mapping(doc, path, required=("from",), optional=tuple(k for k in doc if k != "from"))
    limits = {}
    for name, tier_doc in spec.items():
        if name == "from":
            continue
        where = _join(path, str(name))
        if not isinstance(name, str) or not _LIMIT_NAME_RE.match(name):
            r.fail(where, "tier names may use letters, digits, '_', '-' and '.' only")
        if name == "default":
            r.fail(where, "the limit's own rate and burst are the default tier; name this tier otherwise")
        tier_spec = r.mapping(tier_doc, where, required=("rate",), optional=("burst",))
        rate, burst = _rate_and_burst(tier_spec, where, r)
        # `/` is no limit name character, so LIMIT/TIER is no other limit's bucket.
        limits[name] = dataclasses.replace(base, name=f"{base.name}/{name}", rate=rate, burst=burst)
    if not limits:
        r.fail(path, "expected at least one tier beside `from`")
    origin = r.mapping(spec["from"], f"{path}.from", optional=("file", "header"))
    if len(origin) != 1:
        r.fail(f"{path}.from", "expected exactly one of file (API keys by tier) or header (set by a trusted proxy)")
    if "header" in origin:
        header = r.string(origin["header"], f"{path}.from.header")
        if not HTTP_TOKEN_RE.match(header):
            r.fail(f"{path}.from.header", f"{header!r} is not a valid header name")
        if header.lower() in UNKEYABLE_HEADERS:
            r.fail(f"{path}.from.header", f"{header.lower()} is the gateway's or one hop's own; it names no tier")
        if not trusted:
            r.fail(
                f"{path}.from.header",
                "a tier header is believed only from trusted_proxies, and none are listed, so it would never be read",
            )
        return Tiers(limits=limits, header=header.lower())
    file = r.string(origin["file"], f"{path}.from.file")
    return Tiers(limits=limits, file=file, members=_tier_members(file, f"{path}.from.file", limits, r))


def _tier_members(file: str, path: str, limits: Mapping[str, Limit], r: _Reader) -> dict[str, str]:
    """The key file: `TIER: [KEY, sha256:HEX, ...]`, each key's sha256 hex -> its tier."""
    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        r.fail(path, f"cannot read {file!r}: {exc.strerror}")
    except UnicodeDecodeError:
        r.fail(path, f"cannot read {file!r}: not UTF-8 text")
    try:
        document = safe_yaml.load(text)
    except yaml.YAMLError as exc:
        r.fail(path, f"{file}: malformed YAML: {getattr(exc, 'problem', None) or str(exc).splitlines()[0]}")
    inner = r.within(f"{r.source}: {path}: {file}")
    spec = inner.mapping(document or {}, "", optional=tuple(limits))
    members: dict[str, str] = {}
    for tier, keys in spec.items():
        for i, key in enumerate(inner.sequence(keys, tier)):
            where = f"{tier}[{i}]"
            text = inner.string(key, where)
            hashed = _SHA256_RE.match(text)
            if text.startswith("sha256:") and not hashed:
                inner.fail(where, "expected sha256: and the key's 64 hex digits, as `sha256sum` prints them")
            digest = hashed.group(1).lower() if hashed else hashlib.sha256(text.encode()).hexdigest()
            if digest in members:
                inner.fail(where, f"this key is already in tier {members[digest]!r}")
            members[digest] = tier
    return members
