"""A real Prometheus for tests: Debian's `prometheus` package (scripts/test installs it),
run on a free port with its storage in a temporary directory, and asked through its
HTTP API. Deploy files under deploy/prometheus/ are checked with its `promtool`."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.processes import START_DEADLINE, free_port, terminate, wait_until

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
MISSING = "needs Debian's `prometheus` package (prometheus and promtool); scripts/test installs it"


def require_prometheus() -> None:
    assert Path(PROMETHEUS).exists() and Path(PROMTOOL).exists(), MISSING


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    require_prometheus()
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


class PrometheusServer:
    """`prometheus` with the given config (a dict, written as YAML), listening on a free
    loopback port, its TSDB in a directory of its own that is removed afterwards."""

    def __init__(self, config: dict[str, Any]) -> None:
        require_prometheus()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="gateway-test-prometheus-"))
        self.config_path = self._dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self._log_path = self._dir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        with open(self._log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self._dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            wait_until(self._ready, deadline=START_DEADLINE, what=f"prometheus on port {self.port}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=0.5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        return self._log_path.read_text(errors="replace") if self._log_path.exists() else ""

    async def api(self, client: aiohttp.ClientSession, path: str, **params: str) -> Any:
        """The `data` of a Prometheus HTTP API answer; fails the test on an API error."""
        async with client.get(self.url + "/api/v1/" + path, params=params) as response:
            body = await response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    async def query(self, client: aiohttp.ClientSession, expr: str) -> list[dict[str, Any]]:
        """The series an instant query returns now (a scalar counts as one)."""
        data = await self.api(client, "query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            terminate(self.process)
        shutil.rmtree(self._dir, ignore_errors=True)
