"""Our own Redis client and the shared store built on it.

`connection` is one pipelined RESP connection per node (hiredis packs and
parses); `sentinel` finds the master through Sentinel and `cluster` routes by
hash slot; `nodes` picks between them from the parsed store URL
(`gateway.config.store_url`). `scripts` loads the Lua scripts and calls them by
SHA, `secret` agrees on the fleet's identity-hashing secret, `check_batches`
gathers one loop iteration's checks into one script call, and `store` is the
`RedisStore` the limiter sees through `gateway.limiter.store.Store`.

This package sits below the gateway and beside the limiter: it imports only
`gateway.config` and the limiter's store interface, keys and pure model
helpers, and nothing in `gateway.limiter` imports it. It trusts Redis to answer
correctly, not promptly, and every failure leaves it as `StoreError`.
"""
