"""The top-level settings the loader reads beside limits, routes and the store: the
listener and its TLS, the admin listener's token and host names, the JWT keys, path
normalization, the client-IP strategy and the access log.

Trusts nothing in the file or the environment; an admin token or a JWT secret read
from the environment is never shown in a message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import tls
from gateway.config.http_names import HOST_RE
from gateway.config.model import (
    DEFAULT_LISTEN_BACKLOG,
    ClientIpHeader,
    ClientIpStrategy,
    DotSegments,
    EscapedSlashes,
    JwtConfig,
    JwtFailure,
    ListenTls,
    PathNormalization,
)
from gateway.config.reader import _choice, _Reader, _suggestion
from gateway.config.units import Address, parse_address, parse_duration

# YAML 1.1 reads a bare `off` as false, so both spell "no access log".
ACCESS_LOG_FORMATS = ("text", "json")


def _access_log(value: Any, r: _Reader) -> str | None:
    if value is False or value == "off":
        return None
    if value not in ACCESS_LOG_FORMATS:
        r.fail("access_log", f"expected off, text or json, got {value!r}{_suggestion(value, ('off', *ACCESS_LOG_FORMATS))}")
    return value


MAX_LISTEN_BACKLOG = 65535  # the kernel caps it lower still, at net.core.somaxconn


def _listen(doc: Any, r: _Reader) -> tuple[Address, int, ListenTls | None]:
    """`listen: HOST:PORT`, or `listen: {address: HOST:PORT, backlog: N, tls: {cert, key, min_version}}`."""
    if not isinstance(doc, dict):
        return r.parsed(parse_address, doc, "listen"), DEFAULT_LISTEN_BACKLOG, None
    spec = r.mapping(doc, "listen", required=("address",), optional=("backlog", "tls"))
    address = r.parsed(parse_address, spec["address"], "listen.address")
    backlog = r.integer(
        spec.get("backlog", DEFAULT_LISTEN_BACKLOG), "listen.backlog", minimum=1, maximum=MAX_LISTEN_BACKLOG
    )
    if spec.get("tls") is None:
        return address, backlog, None
    tls_doc = r.mapping(spec["tls"], "listen.tls", required=("cert", "key"), optional=("min_version",))
    min_version = tls_doc.get("min_version", "TLSv1.2")
    if not isinstance(min_version, str) or min_version not in tls.TLS_VERSIONS:
        r.fail("listen.tls.min_version", f"expected {' or '.join(tls.TLS_VERSIONS)}, got {min_version!r}")
    listen_tls = ListenTls(
        cert_file=r.string(tls_doc["cert"], "listen.tls.cert"),
        key_file=r.string(tls_doc["key"], "listen.tls.key"),
        min_version=min_version,
    )
    try:
        tls.server_context(listen_tls)
    except tls.EncryptedKey as exc:
        r.fail("listen.tls.key", str(exc))
    except OSError as exc:
        r.fail("listen.tls", f"cannot load the certificate and key: {exc.strerror or exc}")
    return address, backlog, listen_tls


def _admin_hosts(value: Any, r: _Reader) -> frozenset[str]:
    """The names the admin listener answers to besides IP literals and localhost."""
    names = set()
    for i, item in enumerate(r.sequence(value, "admin_hosts")):
        name = r.string(item, f"admin_hosts[{i}]").lower().removesuffix(".")
        if not HOST_RE.match(name) or name.startswith("["):
            r.fail(f"admin_hosts[{i}]", f"expected a host name without a port, got {item!r}")
        names.add(name)
    return frozenset(names)


def _admin_token(name: Any, r: _Reader, environ: Mapping[str, str]) -> str | None:
    """The admin bearer token from the environment variable `admin_token_env` names; the
    token itself never sits in the file, and no message shows it."""
    if name is None:
        return None
    name = r.string(name, "admin_token_env")
    token = environ.get(name)
    if token is None:
        r.fail("admin_token_env", f"environment variable {name} is not set")
    if len(token) < 16 or not token.isascii() or not token.isprintable() or " " in token:
        r.fail("admin_token_env", f"the token in {name} must be at least 16 visible ASCII characters")
    return token


def _jwt(doc: Any, r: _Reader, environ: Mapping[str, str]) -> JwtConfig:
    spec = r.mapping(
        doc,
        "jwt",
        optional=("secret_env", "public_key_file", "jwks_file", "issuer", "audience", "leeway", "on_invalid"),
    )
    given = [key for key in ("secret_env", "public_key_file", "jwks_file") if key in spec]
    if len(given) != 1:
        r.fail("jwt", "expected exactly one of secret_env (HS256), public_key_file or jwks_file (RS256, ES256)")
    where = f"jwt.{given[0]}"
    value = r.string(spec[given[0]], where)
    # PyJWT and cryptography take 40 ms to import: only a config with a jwt block pays for them.
    from gateway.config import jwt_keys
    if given[0] == "secret_env":
        if value not in environ:
            r.fail(where, f"environment variable {value} is not set")
        keys = (r.parsed(jwt_keys.hs256_key, environ[value], where),)
    elif given[0] == "public_key_file":
        keys = (r.parsed(jwt_keys.public_key_file, value, where),)
    else:
        keys = r.parsed(jwt_keys.jwks_file, value, where)
    on_invalid_text = spec.get("on_invalid", JwtFailure.NEXT.value)
    try:
        on_invalid = JwtFailure(on_invalid_text)
    except ValueError:
        r.fail("jwt.on_invalid", f"expected next or reject, got {on_invalid_text!r}{_suggestion(on_invalid_text, ('next', 'reject'))}")
    return JwtConfig(
        keys=keys,
        issuer=r.string(spec["issuer"], "jwt.issuer") if "issuer" in spec else None,
        audience=r.string(spec["audience"], "jwt.audience") if "audience" in spec else None,
        leeway=r.parsed(parse_duration, spec["leeway"], "jwt.leeway") if "leeway" in spec else 0.0,
        on_invalid=on_invalid,
        keys_from=(given[0], value),
    )


def _path_normalization(doc: Any, r: _Reader) -> PathNormalization:
    spec = r.mapping(doc, "path_normalization", optional=("dot_segments", "escaped_slashes", "merge_slashes"))
    return PathNormalization(
        dot_segments=_choice(
            DotSegments, spec.get("dot_segments", DotSegments.RESOLVE.value), "path_normalization.dot_segments", r
        ),
        escaped_slashes=_choice(
            EscapedSlashes, spec.get("escaped_slashes", EscapedSlashes.KEEP.value), "path_normalization.escaped_slashes", r
        ),
        merge_slashes=r.boolean(spec.get("merge_slashes", True), "path_normalization.merge_slashes"),
    )


def _client_ip(doc: Any, trusted: tuple[Any, ...], r: _Reader) -> ClientIpStrategy:
    spec = r.mapping(doc, "client_ip", optional=("header", "depth"))
    if not trusted:
        r.fail("client_ip", "the client's address is read from a header only when a trusted proxy sent it; list trusted_proxies")
    text = spec.get("header", ClientIpHeader.X_FORWARDED_FOR.value)
    header = _choice(ClientIpHeader, text.lower() if isinstance(text, str) else text, "client_ip.header", r)
    depth = r.integer(spec["depth"], "client_ip.depth", minimum=1) if "depth" in spec else None
    if depth is not None and header is ClientIpHeader.X_REAL_IP:
        r.fail("client_ip.depth", "X-Real-IP holds one address; depth applies to X-Forwarded-For and Forwarded")
    return ClientIpStrategy(header=header, depth=depth)
