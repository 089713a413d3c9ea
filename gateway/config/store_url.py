"""The one parser of `store.url`: where the Redis store is, how to log in, which topology.

`parse_store_url` turns the URL into a frozen target the Redis client connects by:
one node (`redis://`, `rediss://`, `unix://`), a master found through Sentinel
(`redis+sentinel://`) or a Cluster's seed nodes (`redis+cluster://`). Nothing
else reads the URL's parts, so what the loader accepted is exactly what connects.

Trusts nothing in the URL: every part is checked, an option the store would
ignore is rejected, and each ValueError shows the URL with its password redacted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import SplitResult, parse_qs, parse_qsl, unquote, urlsplit

from gateway.config.redaction import redacted_url

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")
# The default ports of a Redis node and of a Sentinel, for a host in a URL that names none.
REDIS_PORT = 6379
SENTINEL_PORT = 26379
_SENTINEL_EXAMPLE = "redis+sentinel://host:26379,host:26380/mymaster"
_CLUSTER_EXAMPLE = "redis+cluster://host:7000,host:7001"

Node = tuple[str, int]


@dataclass(frozen=True, kw_only=True)
class SingleTarget:
    """One Redis node: by host and port (with TLS for `rediss://`), or by unix socket."""

    host: str = ""
    port: int = REDIS_PORT
    unix_path: str = ""
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line
    db: int = 0

    def __str__(self) -> str:
        return self.unix_path if self.unix_path else f"{self.host}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class SentinelTarget:
    """The master Sentinel names `service`. The user and password are the master's; the
    sentinels are asked without one."""

    sentinels: tuple[Node, ...]
    service: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0

    def __str__(self) -> str:
        return f"{self.service} via sentinels {', '.join(f'{h}:{p}' for h, p in self.sentinels)}"


@dataclass(frozen=True, kw_only=True)
class ClusterTarget:
    """A Redis Cluster's seed nodes, asked for the slot map; every node takes the same login."""

    nodes: tuple[Node, ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return "cluster " + ",".join(f"{host}:{port}" for host, port in self.nodes)


StoreTarget = SingleTarget | SentinelTarget | ClusterTarget


def parse_store_url(url: str) -> StoreTarget:
    """`store.url` as a target; raises ValueError with a message for `store.url`."""
    shown = redacted_url(url)  # every message below shows this, never the password
    userinfo = url.partition("://")[2].rpartition("@")[0]
    if any(c in userinfo for c in "/?#"):
        raise ValueError(
            f"the user name or password holds /, ? or #, which end the host part of a URL; "
            f"percent-encode them (%2F, %3F, %23), got {shown!r}"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed `[`, or a bracketed host that is no IPv6 address
        raise ValueError(f"not a URL ({exc}): {shown!r}") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"expected a URL with scheme {', '.join(s + '://' for s in SCHEMES)}, got {shown!r}")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    target: StoreTarget
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"expected unix:///path/to/redis.sock, got {shown!r}")
        _only_options(parts, {"db"})
        target = SingleTarget(unix_path=unquote(parts.path), username=username, password=password, db=_db_option(parts))
    elif parts.scheme == "redis+sentinel":
        try:
            sentinels = split_hosts(parts.netloc, default_port=SENTINEL_PORT)
        except ValueError as exc:
            raise ValueError(f"expected sentinels as in {_SENTINEL_EXAMPLE}: {exc}") from None
        service = parts.path.strip("/")
        if not service or "/" in service:
            raise ValueError(
                f"expected the monitored master's name as the path, as in {_SENTINEL_EXAMPLE}, got {parts.path!r}"
            )
        _only_options(parts, {"db"})
        target = SentinelTarget(
            sentinels=tuple(sentinels), service=unquote(service), username=username, password=password, db=_db_option(parts)
        )
    elif parts.scheme == "redis+cluster":
        try:
            nodes = split_hosts(parts.netloc, default_port=REDIS_PORT)
        except ValueError as exc:
            raise ValueError(f"expected seed nodes as in {_CLUSTER_EXAMPLE}: {exc}") from None
        if parts.path.strip("/"):
            raise ValueError(
                f"a Redis Cluster has only database 0; expected no path, as in {_CLUSTER_EXAMPLE}, got {parts.path!r}"
            )
        _only_options(parts, set())
        target = ClusterTarget(nodes=tuple(nodes), username=username, password=password)
    else:
        if not parts.hostname:
            raise ValueError(f"expected a host, as in redis://127.0.0.1:6379/0, got {shown!r}")
        try:
            port = parts.port or REDIS_PORT
        except ValueError:
            raise ValueError(f"bad port in {shown!r}") from None
        db = parts.path.lstrip("/")
        if db and not (db.isascii() and db.isdigit()):
            raise ValueError(f"expected a database number as the path, as in /0, got {parts.path!r}")
        _only_options(parts, set())
        target = SingleTarget(
            host=parts.hostname,
            port=port,
            tls=parts.scheme == "rediss",
            username=username,
            password=password,
            db=int(db) if db else 0,
        )
    return target


def _only_options(parts: SplitResult, allowed: set[str]) -> None:
    for option, _ in parse_qsl(parts.query, keep_blank_values=True):
        if option not in allowed:
            raise ValueError(f"URL option {option!r} is not supported; set it as a key under `store`")


def _db_option(parts: SplitResult) -> int:
    """`?db=N` of a unix socket or Sentinel URL; the first one counts, and a blank one is 0."""
    db = parse_qs(parts.query).get("db", ["0"])[0]
    if not (db.isascii() and db.isdigit()):
        raise ValueError(f"expected a database number as the db option, as in ?db=0, got {db!r}")
    return int(db)


def split_hosts(netloc: str, *, default_port: int) -> list[Node]:
    """`h1:26379,[::1]:26380` (any user info removed) as (host, port) pairs, for the
    several nodes of a Sentinel or Cluster store URL; raises ValueError."""
    return [_host_port(item.strip(), default_port) for item in netloc.rpartition("@")[2].split(",")]


def _host_port(item: str, default_port: int) -> Node:
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = item.partition(":")
    if not host:
        raise ValueError(f"no host in {item!r}")
    if port and not port.isdigit():
        raise ValueError(f"bad port in {item!r}")
    number = int(port) if port else default_port
    if not 0 < number < 65536:
        raise ValueError(f"bad port in {item!r}")
    return host, number
