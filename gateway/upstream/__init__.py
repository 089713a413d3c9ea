"""The upstream side: HTTP/1.1 to the servers the gateway proxies to, knowing nothing of
routes, limits or aiohttp's server.

- `connection`: one keep-alive connection, an `asyncio.Protocol` with llhttp's parser;
- `client`: the connections of one upstream, with its pool of idle connections;
- `slots`: the bounded number of requests in flight to one upstream;
- `balancing`: which target of a pool of targets takes a request, and each target's state;
- `health_checks`: the active checks that move a target in and out of rotation;
- `errors`: how an attempt fails.

Trusts the config's URLs; trusts nothing an upstream sends.
"""
