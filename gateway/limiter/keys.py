"""From a client identity to a key that the client cannot shape: the gateway's one keyed hash.

An identity value (an API key, an address) is hashed with a keyed BLAKE2b
before it reaches any store, so the key's length and content, and its Redis
Cluster hash slot, are fixed by the gateway's secret, not by the client, and
raw API keys are never written to a store. The same hash, with the secret and
length each use needs, hides identities in the access log and the admin API.

In process memory (the denial cache, leased tokens) an identity is held as
itself while it is short, and as a digest keyed by PROCESS_SECRET once it is
long, so what a client can make the gateway remember per identity is bounded
whatever length it chooses. Trusts nothing it hashes; pure, no I/O.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

# 128 bits: collisions between clients are out of reach, and keys stay short.
DIGEST_BYTES = 16
# Keys what this process hashes without a configured secret (in-memory keys, the admin API's
# and the access log's identities): unknown to clients, so none can aim two identities at
# one entry. Drawn at import, before `gateway run` forks its workers, so every worker shares
# it and an identity hashes alike in whichever worker answers; a reload keeps it.
PROCESS_SECRET = os.urandom(32)


def keyed_digest(secret: bytes, identity: str, size: int = DIGEST_BYTES) -> bytes:
    """`size` bytes of BLAKE2b of `identity` ("source=value"), keyed by `secret` (up to 64 bytes used)."""
    data = identity.encode("utf-8", "surrogateescape")
    return hashlib.blake2b(data, key=secret[:64], digest_size=size).digest()


def identity_digest(secret: bytes, identity: str, size: int = DIGEST_BYTES) -> str:
    """keyed_digest as hex: `size * 2` characters, fixed whatever the identity."""
    return keyed_digest(secret, identity, size).hex()


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


def memory_key(identity: str) -> str | bytes:
    """`identity` as a key of an in-memory structure: itself, or past COMPACT_IDENTITY
    characters its 16-byte digest (bytes, so it never equals a short identity)."""
    if len(identity) <= COMPACT_IDENTITY:
        return identity
    return keyed_digest(PROCESS_SECRET, identity)


@dataclass(frozen=True, slots=True)
class HeldByDigest:
    """A long identity as a list of clients holds it: its source and `identity_digest` keyed
    by PROCESS_SECRET, which is how the admin API shows an identity hashed."""

    source: str
    digest: str

    def __str__(self) -> str:
        return f"{self.source}#{self.digest}"


def listed_identity(identity: str) -> str | HeldByDigest:
    """`identity` as the top-limited list keeps it: itself, or past COMPACT_IDENTITY
    characters its source and digest, so that a list of 8 KiB tokens costs what one of
    API keys does."""
    if len(identity) <= COMPACT_IDENTITY:
        return identity
    return HeldByDigest(identity.partition("=")[0], identity_digest(PROCESS_SECRET, identity))
