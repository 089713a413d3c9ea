"""The public listener's TLS context, built from `listen.tls`.

The loader builds it once to reject a certificate or key that does not load, and
each serving process builds its own from the same files."""

from __future__ import annotations

import ssl

from gateway.config.model import ListenTls

TLS_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}


def server_context(tls: ListenTls) -> ssl.SSLContext:
    """Python's server defaults (no SSLv3, no compression, its cipher list), at least
    `min_version`; raises OSError or ssl.SSLError for a file that does not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.load_cert_chain(tls.cert_file, tls.key_file)
    return context
