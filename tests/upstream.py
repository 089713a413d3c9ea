"""The tests' upstream: a real aiohttp app with the routes a proxy must carry faithfully."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from aiohttp import web

GZIP_TEXT = b"hello, compressed world\n" * 100


async def echo(request: web.Request) -> web.Response:
    """The request as the upstream saw it: method, path, query, every header line, body size."""
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.raw_path,
            "headers": [[k, v] for k, v in request.headers.items()],
            "body": body.decode("latin-1") if len(body) < 65536 else None,
            "body_length": len(body),
        }
    )


async def sink(request: web.Request) -> web.Response:
    """Counts an uploaded body without keeping it; `pause` seconds first, like a busy upstream."""
    await asyncio.sleep(float(request.query.get("pause", "0")))
    total = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        total += len(chunk)
    return web.json_response({"received": total})


async def stream(request: web.Request) -> web.StreamResponse:
    """`size` bytes in 64 KiB chunks, chunked unless `length=1`."""
    size = int(request.query.get("size", "1048576"))
    response = web.StreamResponse()
    if request.query.get("length") == "1":
        response.content_length = size
    response.content_type = "application/octet-stream"
    await response.prepare(request)
    if request.method == "HEAD":
        return response
    block = b"x" * 65536
    sent = 0
    while sent < size:
        piece = block[: min(len(block), size - sent)]
        await response.write(piece)
        sent += len(piece)
    await response.write_eof()
    return response


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(float(request.query.get("seconds", "5")))
    return web.Response(text="slow")


class Held:
    """Requests to /held wait until the test releases them all (POST /held/release);
    GET /held/arrived says how many have come, so a test knows what is in flight."""

    def __init__(self) -> None:
        self.arrived = 0
        self.released = asyncio.Event()


HELD = web.AppKey("held", Held)


async def held(request: web.Request) -> web.Response:
    gate = request.app[HELD]
    gate.arrived += 1
    await gate.released.wait()
    return web.Response(text="held")


async def held_arrived(request: web.Request) -> web.Response:
    return web.json_response({"arrived": request.app[HELD].arrived})


async def held_release(request: web.Request) -> web.Response:
    request.app[HELD].released.set()
    return web.Response(text="released")


async def gzipped(_: web.Request) -> web.Response:
    return web.Response(
        body=gzip.compress(GZIP_TEXT), headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"}
    )


async def set_cookie(_: web.Request) -> web.Response:
    response = web.Response(text="cookies")
    response.headers.add("Set-Cookie", "a=1; Path=/")
    response.headers.add("Set-Cookie", "b=2; Path=/; HttpOnly")
    response.headers.add("X-Multi", "one")
    response.headers.add("X-Multi", "two")
    return response


async def redirect(_: web.Request) -> web.Response:
    return web.Response(status=302, headers={"Location": "/echo"})


async def location(request: web.Request) -> web.Response:
    """A 302 whose Location and Content-Location are `value`, with `{self}` replaced by this
    upstream's own origin as the request reached it (as an app behind a proxy writes its URLs)."""
    value = request.query["value"].replace("{self}", str(request.url.origin()))
    return web.Response(status=302, headers={"Location": value, "Content-Location": value})


async def hop_by_hop(_: web.Request) -> web.Response:
    return web.Response(
        text="hop",
        headers={
            "Connection": "X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=5",
            "Proxy-Connection": "keep-alive",
            "TE": "trailers",
            "Trailer": "X-Checksum",
            "Upgrade": "h2c",
            "X-Kept": "yes",
        },
    )


async def status(request: web.Request) -> web.Response:
    return web.Response(status=int(request.match_info["code"]))


async def websocket(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(protocols=("chat",))
    await ws.prepare(request)
    async for message in ws:
        if message.type == web.WSMsgType.TEXT:
            await ws.send_str("echo:" + message.data)
        elif message.type == web.WSMsgType.BINARY:
            await ws.send_bytes(message.data[::-1])
    return ws


# The close code the upstream's /ws-bye sends: a private-use code (RFC 6455 §7.4.2), so
# a client that sees it knows the upstream's close came through and was not the gateway's own.
UPSTREAM_BYE = 4001


async def _echo_once(request: web.Request) -> web.WebSocketResponse:
    """Accept a WebSocket and echo its first message."""
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    message = await ws.receive()
    if message.type == web.WSMsgType.TEXT:
        await ws.send_str("echo:" + message.data)
    return ws


async def websocket_bye(request: web.Request) -> web.WebSocketResponse:
    """A WebSocket whose upstream ends it: echoes one message, then closes with UPSTREAM_BYE."""
    ws = await _echo_once(request)
    await ws.close(code=UPSTREAM_BYE, message=b"bye")
    return ws


async def websocket_drop(request: web.Request) -> web.WebSocketResponse:
    """A WebSocket whose upstream fails: echoes one message, then drops its connection with no close frame."""
    ws = await _echo_once(request)
    assert request.transport is not None
    request.transport.abort()
    return ws


def upstream_app() -> web.Application:
    app = web.Application(client_max_size=1 << 20)
    app.router.add_route("*", "/echo{tail:.*}", echo)
    app.router.add_post("/sink", sink)
    app.router.add_get("/stream", stream)
    app.router.add_get("/slow", slow)
    app[HELD] = Held()
    app.router.add_get("/held", held)
    app.router.add_get("/held/arrived", held_arrived)
    app.router.add_post("/held/release", held_release)
    app.router.add_get("/gzip", gzipped)
    app.router.add_get("/set-cookie", set_cookie)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/location", location)
    app.router.add_get("/hop", hop_by_hop)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/ws", websocket)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


@contextlib.asynccontextmanager
async def running_upstream() -> AsyncIterator[str]:
    # auto_decompress=False: the echo shows a request body as it arrived on the wire, gzip or not.
    runner = web.AppRunner(upstream_app(), access_log=None, shutdown_timeout=0.1, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()



Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """`handler` behind aiohttp's low-level server (no router: it is handed every request,
    with no 404, 405 or 417 of aiohttp's own), in the running event loop; yields its URL."""
    runner = web.ServerRunner(web.Server(handler), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def _in_a_thread(serve: Callable[[], contextlib.AbstractAsyncContextManager[str]]) -> Iterator[str]:
    """The server `serve()` runs, on an event loop of its own in a thread; yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started = asyncio.Event()
    stop: asyncio.Future[None] = loop.create_future()
    urls: list[str] = []

    async def run() -> None:
        async with serve() as url:
            urls.append(url)
            started.set()
            await stop

    run_done = asyncio.run_coroutine_threadsafe(run(), loop)
    try:
        asyncio.run_coroutine_threadsafe(started.wait(), loop).result(10)
        yield urls[0]
    finally:
        loop.call_soon_threadsafe(stop.set_result, None)
        run_done.result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def serving_in_a_thread(handler: Handler) -> contextlib.AbstractContextManager[str]:
    """`serving`, on an event loop of its own in a thread: for synchronous tests
    (Hypothesis) that drive a gateway process while the upstream answers."""
    return _in_a_thread(lambda: serving(handler))


def upstream_in_a_thread() -> contextlib.AbstractContextManager[str]:
    """`running_upstream`, on an event loop of its own in a thread: it outlives any test's
    event loop, so a gateway that several tests share can stand in front of it."""
    return _in_a_thread(running_upstream)


class CountingUpstream:
    """For `serving`: counts the requests in flight per X-API-Key and the most seen at once.
    Requests to /held wait until `gate` is set, /reset loses its connection, /ws is a
    WebSocket echo, /ws-bye a WebSocket the upstream closes after one echo, /ws-drop one
    whose connection it drops after one echo, with no close frame; any other path answers
    at once. A WebSocket is in flight until the upstream's side of it ends."""

    def __init__(self) -> None:
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.most: collections.Counter[str] = collections.Counter()
        self.gate = asyncio.Event()
        self.ws_closed_with: list[int | None] = []  # each /ws's close code, as the upstream saw it

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        who = request.headers.get("X-API-Key", "")
        self.in_flight[who] += 1
        self.most[who] = max(self.most[who], self.in_flight[who])
        try:
            if request.path == "/held":
                await self.gate.wait()
            elif request.path == "/reset":
                assert request.transport is not None
                request.transport.abort()
            elif request.path == "/ws":
                ws = await websocket(request)  # type: ignore[arg-type]
                self.ws_closed_with.append(ws.close_code)
                return ws
            elif request.path == "/ws-bye":
                return await websocket_bye(request)  # type: ignore[arg-type]
            elif request.path == "/ws-drop":
                return await websocket_drop(request)  # type: ignore[arg-type]
            return web.Response(text="ok")
        finally:
            self.in_flight[who] -= 1


async def _ok(_: web.BaseRequest) -> web.StreamResponse:
    return web.Response(text="ok")


class RecordingUpstream:
    """For `serving`: records the path of every request it is handed (`paths`; `requests`
    counts them) and answers it with `answer`, an "ok" by default. A request is recorded as
    it arrives, before its body is read; with `once_answered`, only once `answer` returned,
    so that a request whose body never ends is never counted."""

    def __init__(self, answer: Handler = _ok, *, once_answered: bool = False) -> None:
        self.paths: list[str] = []
        self._answer = answer
        self._once_answered = once_answered

    @property
    def requests(self) -> int:
        return len(self.paths)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if not self._once_answered:
            self.paths.append(request.path)
        response = await self._answer(request)
        if self._once_answered:
            self.paths.append(request.path)
        return response
