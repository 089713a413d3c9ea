"""GET /config: the effective config as the YAML spells it, every secret replaced by "***".

The answer is JSON: `config` is a document the loader reads back (JSON is YAML), with
the file's own keys (`client_header_timeout`, `listen: {address, tls: {cert, key}}`,
`admin_token_env`), durations, sizes and rates written as the file writes them, and
every default filled in; `defaults` lists the paths whose value is the default,
`redacted` the paths whose value is "***", and `effective` what applies where the file
has no key to say it (a limit without `response.body` answers problem+json). Paths are
spelt as config errors spell them (`routes[0].timeout.read`).

Trusts nothing but the config's own types, and shows no value it does not know to be
safe: the store URL's and the upstreams' passwords, `store.key_secret`, the values a
route writes into headers and the identities of allowlists are "***"; the admin token
and the JWT secret are shown by the variable they were read from, and a tier file's
keys by its path. A field this module does not spell is not shown at all.
"""

from __future__ import annotations

from typing import Any

from gateway.config.limits import DEFAULT_LEASE_TTL
from gateway.config.loader import (
    DEFAULT_ADMIN_LISTEN,
    DEFAULT_CLIENT_BODY_TIMEOUT,
    DEFAULT_CLIENT_HEADER_TIMEOUT,
    DEFAULT_KEEPALIVE_REQUESTS,
    DEFAULT_KEEPALIVE_TIMEOUT,
    DEFAULT_LISTEN,
    DEFAULT_LOCAL_STORE_MEMORY,
    DEFAULT_MAX_DELAYED,
    DEFAULT_MAX_HEADER_SIZE,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_STORE_MAX_PENDING,
    DEFAULT_STORE_PREFIX,
    DEFAULT_STORE_TIMEOUT,
    DEFAULT_UPSTREAM_CONNECTIONS,
)
from gateway.config.model import (
    DEFAULT_IDENTITY_MAX_LENGTH,
    DEFAULT_LEASE_LAPSE,
    DEFAULT_LISTEN_BACKLOG,
    DEFAULT_UPSTREAM_MAX_HEADER_LINES,
    DEFAULT_UPSTREAM_MAX_HEADER_SIZE,
    ClientIpHeader,
    ClientIpStrategy,
    ConcurrencyLimit,
    FailurePolicy,
    ForwardedHeaders,
    GatewayConfig,
    HeaderRules,
    IdentitySource,
    Limit,
    PathNormalization,
    ResponseStyle,
    Route,
    StoreConfig,
    ValueMatch,
)
from gateway.config.pool_model import Balance, UpstreamPool
from gateway.config.reader import _join
from gateway.config.redaction import redacted_url
from gateway.config.routes import DEFAULT_CONNECT_TIMEOUT, DEFAULT_QUEUE_TIMEOUT, DEFAULT_READ_TIMEOUT
from gateway.config.units import parse_duration, parse_size
from gateway.config.upstreams import (
    DEFAULT_EJECT_AFTER,
    DEFAULT_EJECT_FOR,
    DEFAULT_HEALTH_INTERVAL,
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_HEALTHY_AFTER,
    DEFAULT_RETRIES,
    DEFAULT_UNHEALTHY_AFTER,
)
from gateway.decision.problems import PROBLEM_CONTENT_TYPE

REDACTED = "***"
_DEFAULT_KEY = (IdentitySource(kind="ip"),)
# As the headers' registrations spell them; the loader takes any case.
_CLIENT_IP_HEADERS = {
    ClientIpHeader.X_FORWARDED_FOR: "X-Forwarded-For", ClientIpHeader.X_REAL_IP: "X-Real-IP",
    ClientIpHeader.FORWARDED: "Forwarded",
}
_UNITS = (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0))
_SIZES = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def redacted_config(config: GatewayConfig) -> dict[str, Any]:
    """The /config answer: {source, config, defaults, redacted, effective} (see above)."""
    view = _View()
    return {
        "source": config.source,
        "config": view.top(config),
        "defaults": view.defaults,
        "redacted": view.redacted,
        "effective": view.effective,
    }


def duration(seconds: float) -> str:
    """`seconds` as the file writes a duration, in the largest unit that holds it whole,
    and always one that parse_duration reads back to the same number."""
    for unit, size in _UNITS:
        if seconds >= size and (seconds / size).is_integer() and parse_duration(f"{seconds / size:.0f}{unit}") == seconds:
            return f"{seconds / size:.0f}{unit}"
    for digits in range(1, 24):
        for unit, scale in (("ms", 1000.0), ("s", 1.0)):
            text = f"{seconds * scale:.{digits}f}".rstrip("0").rstrip(".") + unit
            if _reads_as(text, seconds):
                return text
    return f"{seconds:.23f}s"  # unreachable for a parsed duration: a double's 17 digits come well before


def _reads_as(text: str, seconds: float) -> bool:
    try:
        return parse_duration(text) == seconds
    except ValueError:  # a digit too few reads as 0
        return False


def size(count: int) -> str:
    """Bytes as the file writes a size: `32KiB`, or a plain number when no unit holds it whole."""
    for unit, bytes_ in _SIZES:
        if count >= bytes_ and count % bytes_ == 0:
            return f"{count // bytes_}{unit}"
    return str(count)


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _key(sources: tuple[IdentitySource, ...]) -> list[Any]:
    return [[str(part) for part in source.parts] if source.kind == "composite" else str(source) for source in sources]


class _View:
    """Spells one config, collecting the paths of defaults, redactions and effective values."""

    def __init__(self) -> None:
        self.defaults: list[str] = []
        self.redacted: list[str] = []
        self.effective: dict[str, Any] = {}

    def put(self, doc: dict[str, Any], path: str, key: str, value: Any, is_default: bool = False) -> None:
        doc[key] = value
        if is_default:
            self.defaults.append(_join(path, key))

    def secret(self, doc: dict[str, Any], path: str, key: str, shown: Any, value: Any) -> None:
        doc[key] = shown
        if shown != value:
            self.redacted.append(_join(path, key))

    def top(self, c: GatewayConfig) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if c.listen_tls is None and c.listen_backlog == DEFAULT_LISTEN_BACKLOG:
            self.put(doc, "", "listen", str(c.listen), str(c.listen) == DEFAULT_LISTEN)
        else:
            listen: dict[str, Any] = {"address": str(c.listen)}
            self.put(listen, "listen", "backlog", c.listen_backlog, c.listen_backlog == DEFAULT_LISTEN_BACKLOG)
            if c.listen_tls is not None:
                tls = {"cert": c.listen_tls.cert_file, "key": c.listen_tls.key_file}
                self.put(tls, "listen.tls", "min_version", c.listen_tls.min_version, c.listen_tls.min_version == "TLSv1.2")
                listen["tls"] = tls
            doc["listen"] = listen
        self.put(doc, "", "admin_listen", str(c.admin_listen), str(c.admin_listen) == DEFAULT_ADMIN_LISTEN)
        if c.decision_listen is not None:
            doc["decision_listen"] = str(c.decision_listen)
        if c.admin_token_env is not None:
            doc["admin_token_env"] = c.admin_token_env
        self.put(doc, "", "admin_hosts", sorted(c.admin_hosts), not c.admin_hosts)
        self.put(doc, "", "admin_raw_identities", c.admin_raw_identities, not c.admin_raw_identities)
        self.put(doc, "", "workers", c.workers, c.workers == 1)
        self.put(doc, "", "max_in_flight", c.max_in_flight, c.max_in_flight == DEFAULT_MAX_IN_FLIGHT)
        self.put(doc, "", "store", self.store(c.store) if c.store is not None else None, c.store is None)
        self.sized(doc, "", "local_store_memory", c.local_store_memory, DEFAULT_LOCAL_STORE_MEMORY)
        self.put(doc, "", "trusted_proxies", [str(n) for n in c.trusted_proxies], not c.trusted_proxies)
        if c.trusted_proxies:  # without, the file may not have `client_ip`
            client_ip: dict[str, Any] = {}
            header = c.client_ip.header
            self.put(client_ip, "client_ip", "header", _CLIENT_IP_HEADERS[header], header is ClientIpStrategy().header)
            if c.client_ip.depth is not None:
                client_ip["depth"] = c.client_ip.depth
            doc["client_ip"] = client_ip
        forwarded = c.forwarded_headers
        self.put(doc, "", "forwarded_headers", forwarded.value, forwarded is ForwardedHeaders.REPLACE)
        if c.jwt is not None:
            jwt: dict[str, Any] = {c.jwt.keys_from[0]: c.jwt.keys_from[1]}
            for name, value in (("issuer", c.jwt.issuer), ("audience", c.jwt.audience)):
                if value is not None:
                    jwt[name] = value
            if c.jwt.leeway:
                jwt["leeway"] = duration(c.jwt.leeway)
            self.put(jwt, "jwt", "on_invalid", c.jwt.on_invalid.value, c.jwt.on_invalid.value == "next")
            doc["jwt"] = jwt
        limits: dict[str, Any] = {}
        for limit in c.limits:
            limits[limit.name] = self.limit(limit, _join("limits", limit.name))
        for cc in c.concurrency_limits:
            limits[cc.name] = self.concurrency(cc, _join("limits", cc.name))
        doc["limits"] = limits
        doc["routes"] = [self.route(route, f"routes[{i}]") for i, route in enumerate(c.routes)]
        self.put(doc, "", "access_log", c.access_log or "off", c.access_log is None)
        self.timed(doc, "", "shutdown_grace", c.shutdown_grace, DEFAULT_SHUTDOWN_GRACE)
        paths = c.path_normalization
        normalization: dict[str, Any] = {}
        doc["path_normalization"] = normalization
        default = PathNormalization()
        self.put(normalization, "path_normalization", "dot_segments", paths.dot_segments.value, paths.dot_segments is default.dot_segments)
        self.put(
            normalization, "path_normalization", "escaped_slashes", paths.escaped_slashes.value,
            paths.escaped_slashes is default.escaped_slashes,
        )
        self.put(normalization, "path_normalization", "merge_slashes", paths.merge_slashes, paths.merge_slashes)
        clients = c.clients
        self.timed(doc, "", "client_header_timeout", clients.header_timeout, DEFAULT_CLIENT_HEADER_TIMEOUT)
        self.timed(doc, "", "client_body_timeout", clients.body_timeout, DEFAULT_CLIENT_BODY_TIMEOUT)
        self.timed(doc, "", "keepalive_timeout", clients.keepalive_timeout, DEFAULT_KEEPALIVE_TIMEOUT)
        self.put(doc, "", "keepalive_requests", clients.keepalive_requests, clients.keepalive_requests == DEFAULT_KEEPALIVE_REQUESTS)
        self.sized(doc, "", "max_header_size", clients.max_header_size, DEFAULT_MAX_HEADER_SIZE)
        self.sized(doc, "", "identity_max_length", c.identity_max_length, DEFAULT_IDENTITY_MAX_LENGTH)
        self.put(doc, "", "max_delayed", c.max_delayed, c.max_delayed == DEFAULT_MAX_DELAYED)
        self.put(
            doc, "", "upstream_connections", c.upstream_connections, c.upstream_connections == DEFAULT_UPSTREAM_CONNECTIONS
        )
        self.sized(doc, "", "upstream_max_header_size", c.upstream_max_header_size, DEFAULT_UPSTREAM_MAX_HEADER_SIZE)
        lines = c.upstream_max_header_lines
        self.put(doc, "", "upstream_max_header_lines", lines, lines == DEFAULT_UPSTREAM_MAX_HEADER_LINES)
        if c.rls is not None:
            doc["rls_listen"] = str(c.rls.listen)
            doc["rls_config"] = c.rls.config_path
            self.put(doc, "", "rls_merge_domains", c.rls.merge_domains, not c.rls.merge_domains)
        return doc

    def timed(self, doc: dict[str, Any], path: str, key: str, seconds: float, default: str) -> None:
        self.put(doc, path, key, duration(seconds), seconds == parse_duration(default))

    def sized(self, doc: dict[str, Any], path: str, key: str, count: int, default: str | int) -> None:
        self.put(doc, path, key, size(count), count == parse_size(default))

    def store(self, store: StoreConfig) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        self.secret(doc, "store", "url", redacted_url(store.url), store.url)
        self.timed(doc, "store", "timeout", store.timeout, DEFAULT_STORE_TIMEOUT)
        self.put(doc, "store", "prefix", store.prefix, store.prefix == DEFAULT_STORE_PREFIX)
        self.put(doc, "store", "local_divisor", store.local_divisor, store.local_divisor == 1)
        self.put(doc, "store", "max_pending", store.max_pending, store.max_pending == DEFAULT_STORE_MAX_PENDING)
        if store.key_secret is not None:
            self.secret(doc, "store", "key_secret", REDACTED, store.key_secret)
        if store.tls_ca_file is not None:
            doc["tls_ca_file"] = store.tls_ca_file
        self.put(doc, "store", "required", store.required, not store.required)
        return doc

    def limit(self, limit: Limit, path: str) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if limit.quota is not None:
            reset = int(limit.quota.reset)
            quota = {"limit": _number(limit.quota.limit), "per": limit.quota.per}
            self.put(quota, f"{path}.quota", "reset", f"{reset // 3600:02d}:{reset % 3600 // 60:02d} UTC", reset == 0)
            doc["quota"] = quota
        else:
            doc["rate"] = limit.rate.text
            self.put(doc, path, "burst", _number(limit.burst), limit.burst == limit.rate.tokens)
        self.put(doc, path, "key", _key(limit.key), limit.key == _DEFAULT_KEY)
        self.failure_policy(doc, path, limit.on_store_error)
        self.put(doc, path, "shadow", limit.shadow, not limit.shadow)
        if limit.max_delay:
            doc["mode"] = "delay"
            doc["max_delay"] = duration(limit.max_delay)
        else:
            self.put(doc, path, "mode", "reject", True)
        self.response(doc, path, limit.response)
        if limit.lease:
            doc["lease"] = limit.lease
            self.put(doc, path, "lease_lapse", duration(limit.lease_lapse), limit.lease_lapse == DEFAULT_LEASE_LAPSE)
        if limit.tiers is not None:
            origin = {"file": limit.tiers.file} if limit.tiers.file is not None else {"header": limit.tiers.header}
            tiers: dict[str, Any] = {"from": origin}
            for name, tier in limit.tiers.limits.items():
                tiers[name] = {"rate": tier.rate.text, "burst": _number(tier.burst)}
            doc["tiers"] = tiers
        if limit.cost is not None:
            doc["cost"] = {"from": str(limit.cost.source), "reserve": limit.cost.reserve}
            self.put(doc["cost"], f"{path}.cost", "missing", limit.cost.missing, limit.cost.missing == limit.cost.reserve)
        if limit.allow is not None:
            allow = [str(network) for network in limit.allow.networks]
            for identity in sorted(limit.allow.identities):
                self.redacted.append(f"{path}.allow[{len(allow)}]")
                allow.append(identity.partition("=")[0] + "=" + REDACTED)
            doc["allow"] = allow
        return doc

    def failure_policy(self, doc: dict[str, Any], path: str, policy: FailurePolicy) -> None:
        self.put(doc, path, "on_store_error", policy.value, policy is FailurePolicy.OPEN)

    def response(self, doc: dict[str, Any], path: str, style: ResponseStyle) -> None:
        """A limit's `response`, the top-level block's keys merged into it (the view shows
        no top-level `response`: each limit spells what applies to it)."""
        response: dict[str, Any] = {"status": style.status, "headers": style.headers.value}
        where = f"{path}.response"
        if style.body is not None:
            response["body"] = style.body.text
            response["content_type"] = style.content_type
        else:  # no key says it: the answer is RFC 9457's, whatever `content_type` held
            self.effective[f"{where}.content_type"] = PROBLEM_CONTENT_TYPE
        self.put(doc, path, "response", response, style == ResponseStyle())

    def concurrency(self, limit: ConcurrencyLimit, path: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"concurrency": limit.concurrency}
        self.timed(doc, path, "lease_ttl", limit.lease_ttl, DEFAULT_LEASE_TTL)
        self.put(doc, path, "key", _key(limit.key), limit.key == _DEFAULT_KEY)
        self.failure_policy(doc, path, limit.on_store_error)
        return doc

    def route(self, route: Route, path: str) -> dict[str, Any]:
        match = route.match
        where = f"{path}.match"
        doc: dict[str, Any] = {"match": {match.form.value: match.path}}
        if match.methods is not None:
            doc["match"]["methods"] = sorted(match.methods)
        if match.host is not None:
            doc["match"]["host"] = match.host
        self.put(doc["match"], where, "case_sensitive", match.case_sensitive, match.case_sensitive)
        for kind, conditions in (("headers", match.headers), ("query", match.query)):
            if conditions:
                doc["match"][kind] = {condition.name: _condition(condition) for condition in conditions}
        if isinstance(route.upstream, UpstreamPool):
            doc["upstream"] = self.pool(route.upstream, f"{path}.upstream")
        else:
            self.secret(doc, path, "upstream", redacted_url(route.upstream), route.upstream)
        # A limit whose cost the response says reserves its own: the route names it alone.
        limits: list[Any] = [
            rl.limit.name if rl.cost == 1 or rl.limit.cost is not None else {"name": rl.limit.name, "cost": rl.cost}
            for rl in route.limits
        ]
        self.put(doc, path, "limits", limits + [cc.name for cc in route.concurrency], not limits and not route.concurrency)
        self.put(doc, path, "strip_prefix", route.strip_prefix, not route.strip_prefix)
        self.put(doc, path, "preserve_host", route.preserve_host, not route.preserve_host)
        self.put(doc, path, "allow_path_parameters", route.allow_path_parameters, not route.allow_path_parameters)
        timeout: dict[str, Any] = {}
        for key, seconds, default in (
            ("connect", route.timeout.connect, DEFAULT_CONNECT_TIMEOUT), ("read", route.timeout.read, DEFAULT_READ_TIMEOUT),
            ("queue", route.timeout.queue, DEFAULT_QUEUE_TIMEOUT),
        ):
            self.timed(timeout, f"{path}.timeout", key, seconds, default)
        if route.timeout.total is not None:
            timeout["total"] = duration(route.timeout.total)
        doc["timeout"] = timeout
        body = route.max_body_size
        self.put(doc, path, "max_body_size", size(body) if body is not None else None, body is None)
        for key, rules in (("request_headers", route.request_headers), ("response_headers", route.response_headers)):
            doc[key] = self.header_rules(rules, _join(path, key))
            if rules == HeaderRules():
                self.defaults.append(_join(path, key))
        return doc

    def header_rules(self, rules: HeaderRules, path: str) -> dict[str, Any]:
        """Names shown, values never: a header a route writes often carries a credential
        (`Authorization: ${TOKEN}`)."""
        doc: dict[str, Any] = {}
        for key, pairs in (("set", rules.set), ("add", rules.add)):
            if pairs:
                doc[key] = {name: REDACTED for name, _ in pairs}
                self.redacted.extend(_join(f"{path}.{key}", name) for name, _ in pairs)
        if rules.remove:
            doc["remove"] = list(rules.remove)
        return doc

    def pool(self, pool: UpstreamPool, path: str) -> dict[str, Any]:
        targets = []
        for i, target in enumerate(pool.targets):
            shown: dict[str, Any] = {}
            self.secret(shown, f"{path}.targets[{i}]", "url", redacted_url(target.url), target.url)
            shown["name"] = target.name
            self.put(shown, f"{path}.targets[{i}]", "weight", target.weight, target.weight == 1)
            targets.append(shown)
        doc: dict[str, Any] = {"targets": targets}
        self.put(doc, path, "balance", pool.balance.value, pool.balance is Balance.ROUND_ROBIN)
        if pool.health is not None:
            health: dict[str, Any] = {"path": pool.health.path}
            where = f"{path}.health"
            self.timed(health, where, "interval", pool.health.interval, DEFAULT_HEALTH_INTERVAL)
            self.timed(health, where, "timeout", pool.health.timeout, DEFAULT_HEALTH_TIMEOUT)
            unhealthy, healthy = pool.health.unhealthy_after, pool.health.healthy_after
            self.put(health, where, "unhealthy_after", unhealthy, unhealthy == DEFAULT_UNHEALTHY_AFTER)
            self.put(health, where, "healthy_after", healthy, healthy == DEFAULT_HEALTHY_AFTER)
            doc["health"] = health
        if pool.passive is None:
            doc["passive"] = "off"
        else:
            passive: dict[str, Any] = {}
            eject_after = pool.passive.eject_after
            self.put(passive, f"{path}.passive", "eject_after", eject_after, eject_after == DEFAULT_EJECT_AFTER)
            self.timed(passive, f"{path}.passive", "eject_for", pool.passive.eject_for, DEFAULT_EJECT_FOR)
            doc["passive"] = passive
        self.put(doc, path, "retries", pool.retries, pool.retries == DEFAULT_RETRIES)
        return doc


def _condition(condition: ValueMatch) -> Any:
    if not condition.present:
        return {"present": False}
    if condition.exact is not None:
        return {"exact": condition.exact}
    if condition.regex is not None:
        return {"regex": condition.regex.pattern}
    return {"present": True}
