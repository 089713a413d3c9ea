"""The benchmark behind `python -m tests.bench`: the gateway against nginx, a
naive aiohttp proxy and probes of what aiohttp's and grpc.aio's servers allow (a
ceiling for proxying, floors for a denial and for each decision service), each a
real process, in interleaved rounds on this machine.

It is not part of the test suite (pytest collects no `test_*` file here): a run
takes minutes and its numbers mean something only on a quiet machine.

- `__main__`: the command line; runs the phases and prints the report
- `install`: wrk, httperf, nginx and redis-server from apt, the `bench` extra from PyPI
- `servers`: nginx (the upstream, and the limit_req proxy) and the Python servers below as processes
- `naive_proxy`: the naive proxy itself, run as its own process
- `ceiling`: the ceiling, aiohttp's `web.Server` with a minimal httptools upstream client
- `denial_floor`: the floor of a denial, aiohttp's `web.Server` answering a fixed 429
- `decision_floor`: the floor of the decision listener, `web.Server` answering a prebuilt 200
- `low_level_server`: runs a `web.Server` handler as its own process, for the three above
- `rls_floor`: the floor of the RLS, grpc.aio answering a prebuilt OK
- `rls_clients`: the RLS's load, grpc.aio channels with calls in flight, run as its own process
- `bulk_upstream`: the tests' aiohttp upstream as its own process, for the streaming phase
- `variants`: what is compared, and how each is started
- `throughput`: wrk in interleaved rounds, with Redis script calls per request
- `latency`: httperf and the open-loop client at a fixed request rate
- `open_loop`: the open-loop client, run as its own process
- `store_checks`: store checks per second without HTTP, against the `limits` library
- `streaming`: 1 GiB each way through a gateway, and how much its RSS grows
- `report`: medians, ratios, targets and the markdown tables
- `instructions`: instructions per request (callgrind) of commits' gateways, and of (g) and (h)
"""
