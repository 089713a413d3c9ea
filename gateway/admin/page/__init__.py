"""The admin listener's web page: plain HTML, CSS and JavaScript shipped as package data
beside this module, and the routes that serve them (`add_page`).

The files hold no data, so they are served to whoever reaches the listener, token or not;
the page's script asks for the token and sends it on every fetch of the data paths, which
still answer 401 without it. Nothing of the request is trusted or read.
"""

from __future__ import annotations

import importlib.resources

from aiohttp import web

# The page's files (this folder), by path: served to anyone who reaches the listener,
# since they hold no data; the data comes from the paths the token guards.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/admin.js": ("admin.js", "text/javascript; charset=utf-8"),
    "/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/admin.css": ("admin.css", "text/css; charset=utf-8"),
}
# No inline script or style and nothing from elsewhere: data the page shows can never run.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# The page's script reads this from <html> to know whether to ask for the token first.
AUTH_MARK = 'data-auth="none"'


def page_file(name: str) -> bytes:
    return importlib.resources.files(__name__).joinpath(name).read_bytes()


def add_page(router: web.UrlDispatcher, *, token_required: bool) -> None:
    for path, (name, content_type) in PAGE_FILES.items():
        body = page_file(name)
        if name == "index.html" and token_required:
            body = body.replace(AUTH_MARK.encode(), b'data-auth="bearer"', 1)

        async def serve(_: web.Request, body: bytes = body, content_type: str = content_type) -> web.Response:
            return web.Response(body=body, headers={**PAGE_HEADERS, "Content-Type": content_type})

        router.add_get(path, serve)
