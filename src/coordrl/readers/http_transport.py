"""A lean HTTP/1.1 keep-alive transport for ``httpx.AsyncClient``, for reader fan-out on plain http.

Why: a reader broadcast is thousands of small POSTs to a few loopback or LAN servers. httpx's default
transport (httpcore over anyio and h11) costs about 0.4 ms of CPU per request even with one
connection, and its pool re-scans every connection for every queued request, so at a few hundred
connections a call costs several milliseconds: a 3,500-call broadcast then takes tens of seconds of
pure client CPU. This transport keeps httpx's client API (requests, responses, exceptions) but
speaks HTTP/1.1 directly on asyncio streams, with a LIFO stack of idle connections per server.

Scope, on purpose: ``http://`` only (``https://`` requests go to httpx's own transport), no proxies,
no HTTP/2, no response streaming (bodies are read whole: reader answers are small). Responses
with ``Content-Length``, chunked encoding or close-delimited bodies are all understood.
Transport failures raise the matching ``httpx`` exceptions (``ConnectError``, ``ReadError``,
``WriteError``, ``RemoteProtocolError``), so retry logic written for httpx works unchanged.

Below httpx, :meth:`LeanAsyncTransport.post_bytes` sends a request whose head the caller serialised
once (see :meth:`LeanAsyncTransport.request_head`) on the same pooled connections: building an
``httpx.Request`` and ``httpx.Response`` per call (header normalisation, cookie extraction) costs
more client CPU than the exchange itself, and a fan-out of hundreds of identical POSTs does not need
it. Both paths share the connection pool, the framing and the error mapping.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx

__all__ = ["Address", "LeanAsyncTransport"]

Address = tuple[str, int]
"""(host, port) of an ``http://`` server: the key of a connection pool."""

_HEADER_LIMIT = 1 << 16
# Hop-by-hop or encoding headers that this transport decides itself.
_SKIP_HEADERS = frozenset({b"accept-encoding", b"connection", b"keep-alive", b"transfer-encoding", b"host"})


class _Conn:
    __slots__ = ("expired", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.expired = False  # aborted by a post_bytes deadline

    def expire(self) -> None:
        """Abort the connection: the pending read or write fails, and the caller sees a timeout."""
        self.expired = True
        self.writer.transport.abort()

    def usable(self) -> bool:
        # An idle connection that the server closed has seen EOF already.
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class LeanAsyncTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive transport on asyncio streams; ``https`` falls back to httpx's transport.

    Args:
        max_idle_per_host: idle connections kept per server (default 256); extra ones are closed.
        connect_timeout_s: limit on opening a TCP connection (default 10 s). Whole-request deadlines
            are the caller's job (``asyncio.timeout``, or ``timeout_s`` of :meth:`post_bytes`); a
            cancelled or timed-out request closes its connection instead of returning it to the pool.
    """

    def __init__(self, max_idle_per_host: int = 256, connect_timeout_s: float = 10.0) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[Address, list[_Conn]] = {}
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            if self._fallback is None:
                n = self.max_idle_per_host
                self._fallback = httpx.AsyncHTTPTransport(
                    limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)
                )
            return await self._fallback.handle_async_request(request)
        key = (request.url.host, request.url.port or 80)
        payload = self._serialise(request, await request.aread())
        conn = await self._checkout(key)
        status, headers, body = await self._exchange(conn, key, payload, request, request.method == "HEAD")
        return httpx.Response(
            status,
            headers=list(headers.items()),
            content=body,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def post_bytes(
        self, address: Address, head: bytes, body: bytes, timeout_s: float | None = None
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """POST ``body`` to ``address`` with a pre-serialised ``head``; returns (status, headers, content).

        ``head`` is the request line and header lines, each ending in CRLF, without
        ``Content-Length`` or the blank line (see :meth:`request_head`); this adds both. Header
        names in the result are lower-case; ``content`` is decoded the way httpx would decode it
        (``Content-Encoding``). Failures raise the same httpx exceptions as a request through
        ``httpx.AsyncClient`` on this transport, without a ``request`` attached.

        ``timeout_s`` bounds the whole call, connecting included: past it the connection is aborted
        and ``httpx.ConnectTimeout`` or ``httpx.ReadTimeout`` raised. One timer per call does it,
        for a fraction of the CPU of wrapping the call in ``asyncio.timeout``, which a fan-out of
        hundreds of requests per event-loop turn pays on its critical path.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        conn = await self._checkout(address, timeout_s)
        payload = b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
        timer = None if deadline is None else loop.call_at(deadline, conn.expire)
        try:
            status, headers, content = await self._exchange(conn, address, payload, None, False)
        except httpx.TransportError as exc:
            if conn.expired:
                raise httpx.ReadTimeout(f"no complete response within {timeout_s}s") from exc
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if b"content-encoding" in headers:
            # Rare (the request offers no Accept-Encoding): let httpx pick and run the decoder.
            encoding = [(b"content-encoding", headers[b"content-encoding"])]
            content = httpx.Response(status, headers=encoding, content=content).content
        return status, headers, content

    @staticmethod
    def request_head(request: httpx.Request) -> bytes:
        """``request``'s request line and headers as sent by this transport, without ``Content-Length``.

        Ends with the CRLF of the last header line and no blank line. Build it once from an
        ``httpx.Request`` made by the client whose defaults should apply (``User-Agent``, ...),
        and pass it to :meth:`post_bytes` for every call with the same URL and headers.
        """
        url = request.url
        host = f"[{url.host}]" if ":" in url.host else url.host  # IPv6 literals keep their brackets
        if url.port not in (None, 80):
            host = f"{host}:{url.port}"
        lines = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (request.method.encode(), url.raw_path, host.encode())]
        for name, value in request.headers.raw:
            if name.lower() not in _SKIP_HEADERS and name.lower() != b"content-length":
                lines.append(b"%s: %s\r\n" % (name, value))
        return b"".join(lines)

    @classmethod
    def _serialise(cls, request: httpx.Request, body: bytes) -> bytes:
        return b"%sContent-Length: %d\r\n\r\n%s" % (cls.request_head(request), len(body), body)

    async def _checkout(self, key: Address, timeout_s: float | None = None) -> _Conn:
        # No transparent re-send on a dropped kept-alive connection: the caller's retry policy
        # decides, and counts the attempt. Idle connections the server closed are weeded out here.
        stack = self._idle.get(key)
        while stack:
            conn = stack.pop()
            if conn.usable():
                return conn
            conn.close()
        limit = self.connect_timeout_s if timeout_s is None else min(self.connect_timeout_s, timeout_s)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(key[0], key[1], limit=_HEADER_LIMIT), limit)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{key[0]}:{key[1]}: {exc}") from exc
        return _Conn(reader, writer)

    def _checkin(self, key: Address, conn: _Conn) -> None:
        stack = self._idle.setdefault(key, [])
        if len(stack) < self.max_idle_per_host and conn.usable():
            stack.append(conn)
        else:
            conn.close()

    async def _exchange(
        self, conn: _Conn, key: Address, payload: bytes, request: httpx.Request | None, head_only: bool
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """Send ``payload`` on ``conn`` and read one whole response: (status, headers, raw body).

        The connection goes back to the pool only after a complete, framed exchange.
        """
        keep = False
        try:
            try:
                conn.writer.write(payload)
                await conn.writer.drain()
            except OSError as exc:
                raise httpx.WriteError(str(exc), request=request) from exc
            try:
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                what = "truncated response head" if exc.partial else "server closed the connection without a response"
                raise httpx.RemoteProtocolError(what, request=request) from exc
            except asyncio.LimitOverrunError as exc:
                raise httpx.RemoteProtocolError("response head too large", request=request) from exc
            except OSError as exc:
                raise httpx.ReadError(str(exc), request=request) from exc
            status, headers, keep = _parse_head(head, request)
            body, delimited = await _read_body(conn.reader, headers, status, request, head_only)
            keep = keep and delimited  # a close-delimited body used the connection up
            return status, headers, body
        except BaseException:
            keep = False  # cancelled or failed mid-exchange: the stream state is unknown
            raise
        finally:
            if keep:
                self._checkin(key, conn)
            else:
                conn.close()

    async def aclose(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()
            self._fallback = None


def _parse_head(head: bytes, request: httpx.Request | None) -> tuple[int, dict[bytes, bytes], bool]:
    lines = head[:-4].split(b"\r\n")
    try:
        version, code, *_ = lines[0].split(b" ", 2)
        status = int(code)
    except ValueError as exc:
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}", request=request) from exc
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}", request=request)
        name = name.strip().lower()
        value = value.strip()
        headers[name] = headers[name] + b", " + value if name in headers else value
    connection = headers.get(b"connection", b"").lower()
    keep = b"close" not in connection and (version == b"HTTP/1.1" or b"keep-alive" in connection)
    return status, headers, keep


async def _read_body(
    reader: asyncio.StreamReader,
    headers: dict[bytes, bytes],
    status: int,
    request: httpx.Request | None,
    head_only: bool,
) -> tuple[bytes, bool]:
    """The body, and whether its end was framed (so the connection can carry another request)."""
    if status in (204, 304) or 100 <= status < 200 or head_only:
        return b"", True
    try:
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            parts = []
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    # Trailers, if any, end with an empty line.
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass
                    return b"".join(parts), True
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
        if b"content-length" in headers:
            return await reader.readexactly(int(headers[b"content-length"])), True
        return await reader.read(), False
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise httpx.RemoteProtocolError(f"truncated or malformed response body: {exc}", request=request) from exc
    except OSError as exc:
        raise httpx.ReadError(str(exc), request=request) from exc
