"""The upstream of the streaming phase: the test suite's aiohttp app
(tests/upstream.py), whose /sink counts an uploaded body without keeping it and
whose /stream generates a body of any size, run as a process of its own so that
the gateway's RSS is the gateway's alone.

    python -m tests.bench.bulk_upstream --port 9001
"""

from __future__ import annotations

import argparse

import uvloop
from aiohttp import web

from tests.upstream import upstream_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(
        upstream_app(), host="127.0.0.1", port=args.port, print=None, access_log=None, loop=uvloop.new_event_loop()
    )


if __name__ == "__main__":
    main()
