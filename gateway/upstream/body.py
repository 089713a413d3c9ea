"""A request body as the upstream side sends it: the one type the proxy hands over and
the client writes, whatever the client's body was.

- `bytes`: the whole body, read before the request went out;
- an async iterable of `bytes`: chunks as they arrive from the client (aiohttp's
  StreamReader, or bytes read ahead and then the rest);
- None: no body.

How each is framed on the wire (Content-Length, or chunked when the length is not
known) is `gateway.upstream.client`'s. Trusts nothing: a source that fails while it is
sent fails the attempt (`BodyFailed`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable

RequestBody = bytes | AsyncIterable[bytes] | None
