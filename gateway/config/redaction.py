"""Secrets out of URLs before they reach a log line, an error message or the admin API.

One rule for every URL the config holds (the store's, the upstreams'): whatever a
person wrote as userinfo is shown without its secret. Trusts nothing about the URL's
shape, since it runs on URLs the loader is about to reject, too.
"""

from __future__ import annotations


def redacted_url(url: str) -> str:
    """`url` with its userinfo's secret replaced by `***`, for error messages and logs.

    The userinfo is everything between `://` and the last `@`, as a person wrote it: a
    password holding an unencoded `#`, `/` or `?` ends urlsplit's netloc early, so
    urlsplit would show the password's tail as a path or fragment. Before a `:`, the user
    name stays; with no `:` the whole userinfo goes, since `redis://password@host` puts a
    password where the user name goes. An `@` in the path or query is redacted too: it is
    rare, and showing too little is the safe side."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if not sep or at < 0:
        return url if "@" not in url else "***" + url[url.rfind("@"):]
    user, colon, _ = rest[:at].partition(":")
    return f"{scheme}://{user + ':***' if colon else '***'}@{rest[at + 1:]}"
