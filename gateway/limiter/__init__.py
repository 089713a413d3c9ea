"""The limiter core, with no HTTP and no Redis in it: bucket and quota math, keys and the
one keyed hash of identities, the store interface and the in-process store, the
decision with its failure policies, waves, denial cache and circuit breaker, and
concurrency leases. It imports only `gateway.config`; the Redis store
(`gateway.redis`) implements its store interface from above, and trusts nothing here
to do I/O but through that interface."""
