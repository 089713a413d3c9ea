"""The public listener's TLS context, built from `listen.tls`.

The loader builds it once to reject a certificate or key that does not load, and
each serving process builds its own from the same files. A reload loads the files
again into that live context, as nginx does on SIGHUP, so a renewed certificate
serves from the next handshake on without a restart. Trusts the files only as far as
they load: a pair that does not is refused at start, and on a reload leaves the
context serving the pair it had."""

from __future__ import annotations

import ssl

from gateway.config.model import ListenTls

TLS_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}
# Offered by ALPN as nginx and Envoy offer it: a client that asks for h2 or http/1.1 is
# told http/1.1, the only protocol served, rather than left to guess.
ALPN_PROTOCOLS = ["http/1.1"]


class EncryptedKey(ValueError):
    """The key file is protected by a passphrase, which a gateway never asks for."""


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL prompts on the controlling terminal and waits there.
    raise EncryptedKey("the key is encrypted; give the gateway an unencrypted key (openssl pkey -in KEY -out KEY.plain)")


def server_context(tls: ListenTls) -> ssl.SSLContext:
    """Python's server defaults (no SSLv3, no compression, its cipher list), at least
    `min_version`; raises OSError, ssl.SSLError or EncryptedKey for files that do not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.set_alpn_protocols(ALPN_PROTOCOLS)
    _load(context, tls)
    return context


def reload_context(context: ssl.SSLContext, tls: ListenTls) -> None:
    """Serve `tls` on the live `context` from its next handshake on. The files are first
    loaded into a context of their own, so a pair that does not load raises here and
    leaves `context` serving what it had."""
    server_context(tls)
    _load(context, tls)


def _load(context: ssl.SSLContext, tls: ListenTls) -> None:
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_passphrase)
