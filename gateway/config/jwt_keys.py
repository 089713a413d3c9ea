"""The keys that verify bearer tokens for `jwt:CLAIM` identities, read once at load.

Trusts nothing in the key files: each is parsed by `cryptography` or PyJWT,
and every way they can fail becomes a ValueError with one line that names
the problem and never the key material, which the loader puts after the
YAML path. Only public keys are accepted from files, and each key is bound
to exactly one algorithm here, so a token cannot choose how it is checked
(no `none`, no HS256 signed with an RSA public key).
"""

from __future__ import annotations

import json

import jwt
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from gateway.config.model import JwtKey

# RFC 7518 §3.2: an HS256 key must be at least as long as the hash, 256 bits.
HS256_MIN_SECRET_BYTES = 32
# The algorithms a public key file or JWKS may name; anything else is refused at load.
PUBLIC_KEY_ALGORITHMS = ("RS256", "ES256")


def hs256_key(secret: str) -> JwtKey:
    raw = secret.encode("utf-8")
    if len(raw) < HS256_MIN_SECRET_BYTES:
        raise ValueError(f"an HS256 secret needs at least {HS256_MIN_SECRET_BYTES} bytes, got {len(raw)}")
    return JwtKey(algorithm="HS256", key=raw)


def public_key_file(path: str) -> JwtKey:
    """A PEM public key: RSA gives RS256, EC P-256 gives ES256."""
    data = _read(path)
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError(f"{path!r} holds no PEM public key (-----BEGIN PUBLIC KEY-----)") from None
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise ValueError(f"the RSA key in {path!r} has {key.key_size} bits; RS256 needs at least 2048")
        return JwtKey(algorithm="RS256", key=key)
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return JwtKey(algorithm="ES256", key=key)
    raise ValueError(f"the key in {path!r} is neither RSA (RS256) nor EC P-256 (ES256)")


def jwks_file(path: str) -> tuple[JwtKey, ...]:
    """Every signing key of a JWKS (RFC 7517) file, each with the algorithm its `alg` or type gives."""
    try:
        document = json.loads(_read(path))
    except ValueError:
        raise ValueError(f"{path!r} is not JSON") from None
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list) or not document["keys"]:
        raise ValueError(f"{path!r} is not a JWKS: expected {{\"keys\": [...]}} with at least one key")
    keys: list[JwtKey] = []
    for i, entry in enumerate(document["keys"]):
        if not isinstance(entry, dict):
            raise ValueError(f"{path!r}: keys[{i}] is not a JSON object")
        if entry.get("use", "sig") != "sig":
            continue  # an encryption key verifies nothing
        if "d" in entry or "k" in entry:
            raise ValueError(f"{path!r}: keys[{i}] is a private or symmetric key; a JWKS file here holds public keys only")
        try:
            parsed = jwt.PyJWK(entry)
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path!r}: keys[{i}] cannot be read: {type(exc).__name__}") from None
        if parsed.algorithm_name not in PUBLIC_KEY_ALGORITHMS:
            raise ValueError(f"{path!r}: keys[{i}] is for {parsed.algorithm_name}; expected one of {', '.join(PUBLIC_KEY_ALGORITHMS)}")
        kid = entry.get("kid")
        keys.append(JwtKey(algorithm=parsed.algorithm_name, key=parsed.key, kid=kid if isinstance(kid, str) else None))
    if not keys:
        raise ValueError(f"{path!r} has no signing key")
    kids = [k.kid for k in keys]
    if len(keys) > 1 and (None in kids or len(set(kids)) != len(kids)):
        raise ValueError(f"{path!r}: with several keys each needs its own `kid`, which tokens name to pick one")
    return tuple(keys)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror}") from None
