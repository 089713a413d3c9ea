"""The upstream side: HTTP/1.1 to the servers the gateway proxies to, knowing nothing of
routes, limits or aiohttp (its own client speaks HTTP/1.1, health checks included).

- `connection`: one keep-alive connection, an `asyncio.Protocol` with llhttp's parser;
- `client`: requests to one upstream, with its idle connections (`IdleConnections`);
- `body`: the request body's one type, as the proxy hands it over;
- `slots`: the bounded number of requests in flight to one upstream;
- `balancing`: which target of a pool of targets takes a request, and each target's state;
- `health_checks`: the active checks that move a target in and out of rotation;
- `errors`: how an attempt fails.

Trusts the config's URLs; trusts nothing an upstream sends.
"""
