"""Real proxies in front of the decision listener, configured with the snippets of
docs/beside-proxies.md as a reader copies them: nginx (auth_request) and Caddy
(forward_auth), each a context manager that always stops the process it started.

The page's blocks are found by the `<!-- snippet: NAME -->` line above each. Their ports
(the proxy's 8080, the application's 3000, the gateway's 8081, 8082 and 9090) are moved by
`on_ports` to free ones through one explicit map, the only change made to them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.processes import free_port, terminate, wait_until

DOC = Path(__file__).resolve().parent.parent / "docs" / "beside-proxies.md"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
CADDY = shutil.which("caddy") or "/usr/bin/caddy"

# The ports the page's snippets and gateway YAML name.
PROXY, APPLICATION, DECISIONS, PUBLIC, ADMIN = 8080, 3000, 8081, 8082, 9090


def doc_snippet(name: str) -> str:
    """The fenced block under `<!-- snippet: NAME -->` on the page, exactly as written."""
    found = re.findall(
        rf"^<!-- snippet: {re.escape(name)} -->\n```[a-z]*\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S
    )
    assert len(found) == 1, f"docs/beside-proxies.md has {len(found)} snippets named {name!r}"
    return found[0]


def fenced_blocks(language: str) -> list[str]:
    """Every ```LANGUAGE block on the page."""
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)


def on_ports(text: str, ports: Mapping[int, int]) -> str:
    """`text` with each `:PORT` the map names (`127.0.0.1:8081`, `:8080 {`) moved to its
    free port; other numbers (`:6379`, `"status":503`) stay as written."""
    return re.sub(r":(\d{4,5})\b", lambda m: f":{ports.get(int(m.group(1)), int(m.group(1)))}", text)


def free_ports() -> dict[int, int]:
    """A free port for each port the page names."""
    return {port: free_port() for port in (PROXY, APPLICATION, DECISIONS, PUBLIC, ADMIN)}


def braced_block(text: str, opener: str) -> tuple[int, int]:
    """Where the block opened by `opener` (`location @name {`, `handle_errors {`) starts and
    ends in an nginx or Caddyfile snippet, its braces matched."""
    start = text.index(opener)
    depth = 0
    for index in range(start + len(opener) - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return start, index + 1
    raise AssertionError(f"{opener} is not closed")


def replace_block(text: str, replacement: str, opener: str) -> str:
    """`text` with its block opened by `opener` replaced by the one in `replacement`, as the
    page tells a reader to do."""
    start, end = braced_block(text, opener)
    new_start, new_end = braced_block(replacement, opener)
    return text[:start] + replacement[new_start:new_end] + text[end:]


def nginx_snippet(choice: str = "open") -> str:
    """The page's nginx snippet, failing open when the gateway cannot be asked (as written),
    or ("closed") with its `location @ratelimiter_down` replaced by the fail-closed one."""
    snippet = doc_snippet("nginx")
    if choice == "open":
        return snippet
    return replace_block(snippet, doc_snippet("nginx-fail-closed"), "location @ratelimiter_down {")


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Nginx:
    """nginx serving `snippet` inside `http { }`, its error log kept for the test to read."""

    def __init__(self, snippet: str, port: int) -> None:
        self.snippet = snippet
        self.url = f"http://127.0.0.1:{port}"
        self._port = port
        self._root = Path(tempfile.mkdtemp(prefix="nginx-test-"))
        self.process: subprocess.Popen | None = None

    def error_log(self) -> str:
        return (self._root / "error.log").read_text(encoding="utf-8", errors="replace")

    def __enter__(self) -> Nginx:
        root = self._root
        for temp in ("body", "proxy"):
            (root / temp).mkdir()
        (root / "nginx.conf").write_text(
            f"""worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
{self.snippet}
}}
""",
            encoding="utf-8",
        )
        self.process = subprocess.Popen(
            [NGINX, "-p", str(root), "-e", str(root / "error.log"), "-c", "nginx.conf", "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: _answers(self._port) or self.process.poll() is not None, what="nginx to listen")
            if self.process.poll() is not None:
                raise AssertionError("nginx did not start: " + self.error_log())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            terminate(self.process)
        shutil.rmtree(self._root, ignore_errors=True)


@contextlib.contextmanager
def running_nginx(*, decision_port: int, upstream_port: int, choice: str = "open") -> Iterator[str]:
    """nginx with the page's snippet (`choice`: "open" or "closed" when the gateway cannot be
    asked) on a free port, the decision listener and the application put where the snippet
    names 8081 and 3000; yields its URL."""
    ports = {PROXY: free_port(), DECISIONS: decision_port, APPLICATION: upstream_port}
    with Nginx(on_ports(nginx_snippet(choice), ports), ports[PROXY]) as nginx:
        yield nginx.url


def caddy_snippet(choice: str = "open") -> str:
    """The page's Caddyfile site block, failing open (as written), or ("closed") with its
    `handle_errors` replaced by the fail-closed one."""
    snippet = doc_snippet("caddy")
    if choice == "open":
        return snippet
    return replace_block(snippet, doc_snippet("caddy-fail-closed"), "handle_errors {")


class Caddy:
    """`caddy run` on a Caddyfile of `snippet` (a site block), with no admin endpoint (its
    default, localhost:2019, would be shared by every Caddy on the machine) and its state in
    a directory of its own; `log` holds what it wrote to stderr once it stopped."""

    def __init__(self, snippet: str, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._port = port
        self._root = Path(tempfile.mkdtemp(prefix="caddy-test-"))
        (self._root / "Caddyfile").write_text("{\n\tadmin off\n}\n\n" + snippet, encoding="utf-8")
        self.process: subprocess.Popen | None = None
        self.log = ""

    def __enter__(self) -> Caddy:
        root = str(self._root)
        with open(self._root / "caddy.log", "wb") as log:
            self.process = subprocess.Popen(
                [CADDY, "run", "--config", str(self._root / "Caddyfile"), "--adapter", "caddyfile"],
                stdout=subprocess.DEVNULL, stderr=log,
                env={**os.environ, "HOME": root, "XDG_CONFIG_HOME": root, "XDG_DATA_HOME": root},
            )
        try:
            wait_until(lambda: _answers(self._port) or self.process.poll() is not None, what="caddy to listen")
            if self.process.poll() is not None:
                raise AssertionError("caddy did not start: " + (self._root / "caddy.log").read_text())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            terminate(self.process)
            self.log = (self._root / "caddy.log").read_text(errors="replace")
        shutil.rmtree(self._root, ignore_errors=True)


@contextlib.contextmanager
def running_caddy(*, decision_port: int, upstream_port: int, choice: str = "open") -> Iterator[str]:
    """Caddy with the page's site block, ports moved as for nginx; yields its URL."""
    ports = {PROXY: free_port(), DECISIONS: decision_port, APPLICATION: upstream_port}
    with Caddy(on_ports(caddy_snippet(choice), ports), ports[PROXY]) as caddy:
        yield caddy.url
