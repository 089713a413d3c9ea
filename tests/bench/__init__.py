"""The benchmark behind `python -m tests.bench`: the gateway against nginx and a
naive aiohttp proxy, each a real process, in interleaved rounds on this machine.

It is not part of the test suite (pytest collects no `test_*` file here): a run
takes minutes and its numbers mean something only on a quiet machine.

- `__main__`: the command line; runs the phases and prints the report
- `install`: wrk, httperf, nginx and redis-server from apt, the `bench` extra from PyPI
- `servers`: nginx (the upstream, and the limit_req proxy) and the naive proxy as processes
- `naive_proxy`: the naive proxy itself, run as its own process
- `variants`: what is compared, and how each is started
- `throughput`: wrk in interleaved rounds, with Redis script calls per request
- `latency`: httperf and the open-loop client at a fixed request rate
- `open_loop`: the open-loop client, run as its own process
- `store_checks`: store checks per second without HTTP, against the `limits` library
- `report`: medians, ratios, targets and the markdown tables
"""
