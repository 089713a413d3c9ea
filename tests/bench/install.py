"""What the benchmark needs and the test suite does not: wrk, httperf and nginx
from Debian's packages (and redis-server, as the suite itself installs it), and
the `bench` extra of pyproject.toml from PyPI. Each is installed only when
missing, and a failed install is one line of `BenchError`, not a traceback."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Tool on PATH -> the Debian package that provides it. nginx-light is the smallest
# build that still has proxy_pass, upstream keepalive and limit_req.
APT_PACKAGES = {"wrk": "wrk", "httperf": "httperf", "nginx": "nginx-light", "redis-server": "redis-server"}
# nginx lives in /usr/sbin, which is on root's PATH but not always on a user's.
EXTRA_TOOL_DIRS = ("/usr/sbin", "/sbin")

# Modules imported from the `bench` extra: `limits` itself and coredis, the client
# its `async+redis://` storage uses by default (the store-check phase), and
# httptools, the ceiling's response parser, and grpc, the RLS variant's client.
BENCH_EXTRA_MODULES = ("limits", "coredis", "httptools", "grpc")
BENCH_EXTRA = "bench"


class BenchError(Exception):
    """The benchmark cannot go on; str() is the one line shown to the user."""


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for directory in EXTRA_TOOL_DIRS:
        candidate = Path(directory) / name
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def ensure_tools() -> dict[str, str]:
    """The path of each tool in APT_PACKAGES, installing the missing ones with apt-get."""
    missing = sorted({package for tool, package in APT_PACKAGES.items() if find_tool(tool) is None})
    if missing:
        _apt_install(missing)
    paths = {tool: find_tool(tool) for tool in APT_PACKAGES}
    still_missing = [tool for tool, path in paths.items() if path is None]
    if still_missing:
        raise BenchError(f"apt-get installed {' '.join(missing)} but {', '.join(still_missing)} is still not found")
    return {tool: path for tool, path in paths.items() if path is not None}


def _apt_install(packages: list[str]) -> None:
    if os.geteuid() != 0:
        raise BenchError(f"missing {' '.join(packages)}; install them as root: apt-get install {' '.join(packages)}")
    print(f"bench: installing {' '.join(packages)} with apt-get", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env)
        except FileNotFoundError:
            raise BenchError(f"missing {' '.join(packages)} and there is no apt-get to install them") from None
        if result.returncode != 0:
            reason = (result.stderr.strip() or result.stdout.strip()).splitlines()
            raise BenchError(f"{' '.join(command[:2])} failed: {reason[-1] if reason else f'exit {result.returncode}'}")


def ensure_bench_extra() -> None:
    """pip-install the `bench` extra's requirements into the running venv when any is missing."""
    if all(importlib.util.find_spec(module) for module in BENCH_EXTRA_MODULES):
        return
    if sys.prefix == sys.base_prefix:
        raise BenchError("run it with the project's venv (.venv/bin/python -m tests.bench), which pip may install into")
    requirements = bench_extra_requirements()
    print(f"bench: installing {' '.join(requirements)} with pip", file=sys.stderr)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or result.stderr.splitlines()
        raise BenchError(f"pip install {' '.join(requirements)} failed: {errors[-1] if errors else result.returncode}")
    importlib.invalidate_caches()


def bench_extra_requirements() -> list[str]:
    """The `bench` optional dependencies as pyproject.toml lists them, so versions live in one place."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)["project"]
    return list(project["optional-dependencies"][BENCH_EXTRA])
