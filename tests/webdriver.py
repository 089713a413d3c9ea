"""Headless Chromium for tests, driven over the W3C WebDriver protocol: chromedriver
is an HTTP server, and the few commands the tests need are one request each.

Spoken with aiohttp rather than through selenium, so a test's event loop (which runs
the tests' upstream) is never blocked by a browser command, nothing is added to the
test dependencies, and nothing can try to download a driver or browser: the Debian
packages' /usr/bin/chromium and /usr/bin/chromedriver are used as installed."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import subprocess
import tempfile
import time
from typing import Any

import aiohttp

from tests.processes import START_DEADLINE, eventually, free_port, terminate

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WINDOW = (1280, 900)
# The key under which WebDriver names an element it found.
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"


def browser_installed() -> bool:
    return bool(shutil.which("chromium") and shutil.which("chromedriver"))


class WebDriverError(AssertionError):
    pass


class Browser:
    """One headless Chromium session, in an async context manager that always ends it
    and the chromedriver it started."""

    def __init__(self) -> None:
        self.port = free_port()
        self._profile = tempfile.mkdtemp(prefix="gateway-test-chromium-")
        self._driver: subprocess.Popen | None = None
        self._http: aiohttp.ClientSession | None = None
        self._session = ""

    async def __aenter__(self) -> Browser:
        self._driver = subprocess.Popen(
            [CHROMEDRIVER, f"--port={self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._http = aiohttp.ClientSession(f"http://127.0.0.1:{self.port}", timeout=aiohttp.ClientTimeout(total=30))
        try:
            await eventually(self._driver_ready, what="chromedriver to answer", deadline=START_DEADLINE)
            width, height = WINDOW
            created = await self._command("POST", "/session", {
                "capabilities": {"alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": CHROMIUM,
                        # --no-sandbox: Chromium refuses to start as root with its sandbox.
                        "args": ["--headless=new", "--no-sandbox", f"--window-size={width},{height}",
                                 "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                                 f"--user-data-dir={self._profile}", "--lang=en-US"],
                    },
                    "goog:loggingPrefs": {"browser": "ALL"},
                }},
            })
            self._session = created["sessionId"]
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._session and self._http is not None:
                with contextlib.suppress(WebDriverError, aiohttp.ClientError, TimeoutError):
                    await self._command("DELETE", f"/session/{self._session}")
        finally:
            if self._http is not None:
                await self._http.close()
            if self._driver is not None:
                terminate(self._driver)
            shutil.rmtree(self._profile, ignore_errors=True)

    async def _driver_ready(self) -> bool:
        assert self._driver is not None and self._http is not None
        if self._driver.poll() is not None:
            raise AssertionError(f"chromedriver exited with {self._driver.returncode}")
        try:
            async with self._http.get("/status") as response:
                return response.status == 200 and (await response.json())["value"]["ready"]
        except aiohttp.ClientError:
            return False

    async def _command(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        assert self._http is not None
        async with self._http.request(method, path, json=body) as response:
            answer = await response.json()
        if response.status != 200:
            raise WebDriverError(f"{method} {path}: {response.status} {answer.get('value')}")
        return answer["value"]

    async def session(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return await self._command(method, f"/session/{self._session}{path}", body)

    async def get(self, url: str) -> None:
        await self.session("POST", "/url", {"url": url})

    async def run(self, script: str, *args: Any) -> Any:
        """The value of `script`, a function body run in the page with `arguments`."""
        return await self.session("POST", "/execute/sync", {"script": script, "args": list(args)})

    async def find(self, css: str) -> str:
        return (await self.session("POST", "/element", {"using": "css selector", "value": css}))[ELEMENT]

    async def type(self, css: str, text: str) -> None:
        """Click the element, then send `text` to it as keystrokes."""
        element = await self.find(css)
        await self.session("POST", f"/element/{element}/click", {})
        await self.session("POST", f"/element/{element}/value", {"text": text})

    async def click(self, css: str) -> None:
        await self.session("POST", f"/element/{await self.find(css)}/click", {})

    async def screenshot(self) -> bytes:
        return base64.b64decode(await self.session("GET", "/screenshot"))

    async def console(self) -> list[dict[str, Any]]:
        """Browser log entries (console messages, script errors, failed loads) since the last call."""
        return await self.session("POST", "/se/log", {"type": "browser"})

    async def until(self, script: str, *args: Any, what: str, deadline: float = 10.0) -> Any:
        """Poll `script` until it returns something truthy, and return that."""
        end = time.monotonic() + deadline
        last = None
        while time.monotonic() < end:
            last = await self.run(script, *args)
            if last:
                return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last: {last!r}")
