"""The decision core: what the proxy, the decision listener and Envoy's rate-limit service
each ask before anything else, answered in one place. It takes what a route's plan (or the
rate-limit service's descriptors) compiled and the request's identities, asks the limiter,
and returns a small verdict: allowed with its RateLimit fields, or refused with its answer
prebuilt as bytes. It holds no aiohttp or grpc type: each listener only translates a verdict
into its own protocol."""
