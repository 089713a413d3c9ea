"""Envoy's gRPC rate-limit service (envoy.service.ratelimit.v3.RateLimitService) on the
gateway's limiter: `service.py` answers ShouldRateLimit and serves it, `descriptors.py` finds
each descriptor's rate limit, `bounds.py` caps a request and sets grpcio's limits, and
`generated/` holds the protobuf and gRPC code. Needs the `envoy` extra (grpcio, protobuf);
imported only when `rls_listen` is set. Never imports the proxy.
"""
