"""Claims of a verified bearer token, for `jwt:CLAIM` identity sources.

Trust model: a token is believed only once its signature checks out against
a key from the config, with that key's one algorithm, and its `exp`, `nbf`,
and the configured `iss` and `aud` hold. A token that is malformed, unsigned
(`alg: none`), signed by another key, expired or not yet valid is no identity
at all: the caller falls back to the limit's next source, or rejects the
request. PyJWT does the JWS work; its errors end here, as None.

A token that verified is remembered until its `exp`, so a returning client
costs a dict hit: the claims of one token never change, the keys are fixed at
load, and `nbf` once passed stays passed; only `exp` is checked again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from gateway.config.model import JwtConfig, JwtFailure, JwtKey

BEARER = "bearer"
# Verifying costs 46 µs (HS256) to 133 µs (ES256), against a few µs for the rest of a
# limited request's identity, so tokens that verified are kept. Bounded because clients
# choose tokens; when full it starts over. Forged tokens are never kept, so they cannot
# evict real ones; longer tokens than this are verified each time, never kept.
VERIFIED_MEMO_SIZE = 4096
VERIFIED_MEMO_TOKEN_CHARS = 4096


class JwtVerifier:
    def __init__(self, config: JwtConfig, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock  # wall-clock seconds, as `exp` is
        # token -> (claims, the time after which it has expired, or None if it never does)
        self._verified: dict[str, tuple[Mapping[str, Any], float | None]] = {}
        self._single = config.keys[0] if len(config.keys) == 1 else None
        self._by_kid = {key.kid: key for key in config.keys if key.kid is not None}
        # PyJWT and cryptography take 40 ms to import: only a config with a jwt block pays for them.
        import jwt

        self._header = jwt.get_unverified_header
        self._invalid = jwt.InvalidTokenError
        self._jwt = jwt.PyJWT(options={"verify_signature": True, "verify_exp": True, "verify_nbf": True})

    @property
    def rejects(self) -> bool:
        """Whether an invalid token rejects the request (401) instead of falling back."""
        return self._config.on_invalid is JwtFailure.REJECT

    def claims(self, token: str) -> Mapping[str, Any] | None:
        """The claims of `token` if it verifies, else None."""
        known = self._verified.get(token)
        if known is not None:
            remembered, expires = known
            if expires is None or self._clock() < expires:  # as PyJWT: expired once now >= exp + leeway
                return remembered
            del self._verified[token]
            return None
        claims = self._verify(token)
        if claims is not None and len(token) <= VERIFIED_MEMO_TOKEN_CHARS:
            if len(self._verified) >= VERIFIED_MEMO_SIZE:
                self._verified.clear()
            self._verified[token] = (claims, self._expiry(claims.get("exp")))
        return claims

    def _expiry(self, exp: Any) -> float | None:
        """When a verified token stops counting: PyJWT reads `exp` as int(exp) (a number, or a
        string of digits) and refuses it once now >= exp + leeway. None if never, including an
        `exp` too large for a float (a 400-digit integer), which would not end before then."""
        if exp is None:
            return None
        try:
            return float(int(exp)) + self._config.leeway
        except OverflowError:
            return None

    def _verify(self, token: str) -> Mapping[str, Any] | None:
        try:
            key = self._key(self._header(token))
            if key is None:
                return None
            claims = self._jwt.decode(
                token,
                key.key,
                algorithms=[key.algorithm],
                issuer=self._config.issuer,
                audience=self._config.audience,
                leeway=self._config.leeway,
            )
        except self._invalid:  # the base of every way a token fails to verify
            return None
        return claims if isinstance(claims, dict) else None

    def _key(self, header: Mapping[str, Any]) -> JwtKey | None:
        kid = header.get("kid")
        if kid is None:
            return self._single
        if not isinstance(kid, str):
            return None
        if self._single is not None:
            return self._single if self._single.kid in (None, kid) else None
        return self._by_kid.get(kid)


def bearer_token(authorization: str) -> str | None:
    """The token of `Authorization: Bearer TOKEN` (RFC 6750 §2.1; the scheme is case-insensitive)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != BEARER:
        return None
    token = token.strip()
    return token or None


def claim_value(claims: Mapping[str, Any], name: str) -> str | None:
    """A claim as an identity: a string or an integer (`sub` may be either); anything else is absent."""
    value = claims.get(name)
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value or None
    if isinstance(value, int):
        return str(value)
    return None
