"""Claims of a verified bearer token, for `jwt:CLAIM` identity sources.

Trust model: a token is believed only once its signature checks out against
a key from the config, with that key's one algorithm, and its `exp`, `nbf`,
and the configured `iss` and `aud` hold. A token that is malformed, unsigned
(`alg: none`), signed by another key, expired or not yet valid is no identity
at all: the caller falls back to the limit's next source, or rejects the
request. PyJWT does the JWS work; its errors end here, as None.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jwt

from gateway.config.model import JwtConfig, JwtKey

BEARER = "bearer"


class JwtVerifier:
    def __init__(self, config: JwtConfig) -> None:
        self._config = config
        self._single = config.keys[0] if len(config.keys) == 1 else None
        self._by_kid = {key.kid: key for key in config.keys if key.kid is not None}
        self._jwt = jwt.PyJWT(options={"verify_signature": True, "verify_exp": True, "verify_nbf": True})

    @property
    def rejects(self) -> bool:
        """Whether an invalid token rejects the request (401) instead of falling back."""
        return self._config.on_invalid.value == "reject"

    def claims(self, token: str) -> Mapping[str, Any] | None:
        """The claims of `token` if it verifies, else None."""
        try:
            key = self._key(jwt.get_unverified_header(token))
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
        except jwt.InvalidTokenError:  # the base of every way a token fails to verify
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
