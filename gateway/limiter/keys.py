"""From a client identity to a bucket key that the client cannot shape.

An identity value (an API key, an address) is hashed with a keyed BLAKE2b
before it reaches any store, so the key's length and content, and its Redis
Cluster hash slot, are fixed by the gateway's secret, not by the client, and
raw API keys are never written to a store.
"""

from __future__ import annotations

import hashlib

# 128 bits: collisions between clients are out of reach, and keys stay short.
DIGEST_BYTES = 16


def identity_digest(secret: bytes, identity: str) -> str:
    """A fixed-length hex digest of `identity` ("source=value"), keyed by `secret`."""
    data = identity.encode("utf-8", "surrogateescape")
    return hashlib.blake2b(data, key=secret[:64], digest_size=DIGEST_BYTES).hexdigest()


def bucket_key(prefix: str, limit_name: str, digest: str) -> str:
    """`{prefix}{limit}:{{digest}}`: the braces make the digest the Redis Cluster hash tag,
    so every bucket of one identity lives in one slot."""
    return f"{prefix}{limit_name}:{{{digest}}}"


def lease_key(prefix: str, limit_name: str, digest: str) -> str:
    """`{prefix}{limit}:leases:{{digest}}`: an identity's concurrency leases. Limit names hold
    no `:`, so no lease key is ever a bucket key, even of a limit renamed across a reload."""
    return f"{prefix}{limit_name}:leases:{{{digest}}}"
