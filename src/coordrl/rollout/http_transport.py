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
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx

__all__ = ["LeanAsyncTransport"]

_HEADER_LIMIT = 1 << 16
# Hop-by-hop or encoding headers that this transport decides itself.
_SKIP_HEADERS = frozenset({b"accept-encoding", b"connection", b"keep-alive", b"transfer-encoding", b"host"})


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

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
            are the caller's job (e.g. ``asyncio.timeout``); a cancelled request closes its
            connection instead of returning it to the pool.
    """

    def __init__(self, max_idle_per_host: int = 256, connect_timeout_s: float = 10.0) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
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
        return await self._exchange(conn, key, request, payload)

    @staticmethod
    def _serialise(request: httpx.Request, body: bytes) -> bytes:
        url = request.url
        host = f"[{url.host}]" if ":" in url.host else url.host  # IPv6 literals keep their brackets
        if url.port not in (None, 80):
            host = f"{host}:{url.port}"
        lines = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (request.method.encode(), url.raw_path, host.encode())]
        for name, value in request.headers.raw:
            if name.lower() not in _SKIP_HEADERS and name.lower() != b"content-length":
                lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        lines.append(body)
        return b"".join(lines)

    async def _checkout(self, key: tuple[str, int]) -> _Conn:
        # No transparent re-send on a dropped kept-alive connection: the caller's retry policy
        # decides, and counts the attempt. Idle connections the server closed are weeded out here.
        stack = self._idle.get(key)
        while stack:
            conn = stack.pop()
            if conn.usable():
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(key[0], key[1], limit=_HEADER_LIMIT), self.connect_timeout_s
            )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{key[0]}:{key[1]}: {exc}") from exc
        return _Conn(reader, writer)

    def _checkin(self, key: tuple[str, int], conn: _Conn) -> None:
        stack = self._idle.setdefault(key, [])
        if len(stack) < self.max_idle_per_host and conn.usable():
            stack.append(conn)
        else:
            conn.close()

    async def _exchange(
        self, conn: _Conn, key: tuple[str, int], request: httpx.Request, payload: bytes
    ) -> httpx.Response:
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
            body, delimited = await _read_body(conn.reader, headers, status, request)
            keep = keep and delimited  # a close-delimited body used the connection up
            return httpx.Response(
                status,
                headers=[(k, v) for k, v in headers.items()],
                content=body,
                request=request,
                extensions={"http_version": b"HTTP/1.1"},
            )
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


def _parse_head(head: bytes, request: httpx.Request) -> tuple[int, dict[bytes, bytes], bool]:
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
    reader: asyncio.StreamReader, headers: dict[bytes, bytes], status: int, request: httpx.Request
) -> tuple[bytes, bool]:
    """The body, and whether its end was framed (so the connection can carry another request)."""
    if status in (204, 304) or 100 <= status < 200 or request.method == "HEAD":
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
