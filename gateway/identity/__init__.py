"""Who a client is, for rate limiting: the identity a limit keys a request on.

`sources` reads a request's identity sources (the client address through the
trusted proxies, headers, queries, cookies, composites, host, method, path) and
holds the trust model; `values` reads one header, query or cookie only when the
upstream will read it alike; `jwt` believes a `jwt:CLAIM` only from a token that
verifies; `tiers` puts an identity in its tier or allowlist; `methods` bounds a
request method for identities and metric labels alike. The admin API reads an
operator's values through `sources.identity_value`, the proxy's own rules.

Identities are hashed by the limiter's one keyed hash (`gateway.limiter.keys`),
which sits below this package so the stores can use it. The modules here trust
the config and nothing a client sent; this package imports nothing by itself.
"""
