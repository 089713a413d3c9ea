"""From a client identity to a bucket key that the client cannot shape.

An identity value (an API key, an address) is hashed with a keyed BLAKE2b
before it reaches any store, so the key's length and content, and its Redis
Cluster hash slot, are fixed by the gateway's secret, not by the client, and
raw API keys are never written to a store.

In process memory (the denial cache, leased tokens) an identity is held as
itself while it is short, and as a digest keyed by a secret of this process
once it is long, so what a client can make the gateway remember per identity is
bounded whatever length it chooses.
"""

from __future__ import annotations

import hashlib
import os

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


# Identities this short ("ip=203.0.113.7", an API key of 64 characters) are held as they
# are: a digest would cost more to compute than it saves.
COMPACT_IDENTITY = 128
# Keys the in-memory digests: unknown to clients, so none can aim two identities at one entry.
_PROCESS_SECRET = os.urandom(32)


def memory_key(identity: str) -> str | bytes:
    """`identity` as a key of an in-memory structure: itself, or past COMPACT_IDENTITY
    characters its 16-byte digest (bytes, so it never equals a short identity)."""
    if len(identity) <= COMPACT_IDENTITY:
        return identity
    data = identity.encode("utf-8", "surrogateescape")
    return hashlib.blake2b(data, key=_PROCESS_SECRET, digest_size=DIGEST_BYTES).digest()
