"""LeanAsyncTransport: HTTP/1.1 framing, keep-alive reuse, closed idle connections, error mapping."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from coordrl.readers.http_transport import LeanAsyncTransport

pytestmark = pytest.mark.timeout(30)


class RawServer:
    """Loopback server replying with canned raw bytes; counts connections and requests."""

    def __init__(self, replies: list[bytes], close_after_reply: bool = False):
        self.replies = list(replies)
        self.close_after_reply = close_after_reply
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                writer.write(self.replies.pop(0))
                await writer.drain()
                if self.close_after_reply:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def ok(body: bytes = b'{"a": 1}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def _post(client: httpx.AsyncClient, url: str, payload: dict) -> httpx.Response:
    return await client.post(url + "/v1/x?q=1", json=payload, headers={"Authorization": "Bearer k"})


def test_keep_alive_reuses_one_connection_and_frames_the_request():
    async def go():
        async with RawServer([ok(), ok(b'{"a": 2}')]) as srv:
            async with httpx.AsyncClient(transport=LeanAsyncTransport()) as client:
                r1 = await _post(client, srv.url, {"n": 1})
                r2 = await _post(client, srv.url, {"n": 2})
            assert (r1.json(), r2.json()) == ({"a": 1}, {"a": 2})
            assert srv.connections == 1
            head, body = srv.requests[0].split(b"\r\n\r\n", 1)
            assert head.startswith(b"POST /v1/x?q=1 HTTP/1.1\r\nHost: 127.0.0.1:")
            assert b"\r\nAuthorization: Bearer k\r\n" in head
            assert b"accept-encoding" not in head.lower()  # bodies must come back uncompressed
            assert body == b'{"n":1}'

    asyncio.run(go())


def test_chunked_and_close_delimited_bodies():
    chunked = b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\n\r\n"
    close_delimited = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-eof"

    async def go():
        async with RawServer([chunked, ok()]) as srv, httpx.AsyncClient(transport=LeanAsyncTransport()) as client:
            r = await _post(client, srv.url, {})
            assert (r.status_code, r.text) == (500, "abcdefg")
            assert (await _post(client, srv.url, {})).json() == {"a": 1}
            assert srv.connections == 1
        async with RawServer([close_delimited, ok()], close_after_reply=True) as srv:
            async with httpx.AsyncClient(transport=LeanAsyncTransport()) as client:
                assert (await _post(client, srv.url, {})).text == "until-eof"
                assert (await _post(client, srv.url, {})).json() == {"a": 1}
            assert srv.connections == 2

    asyncio.run(go())


def test_idle_connection_closed_by_server_is_replaced():
    async def go():
        async with RawServer([ok(), ok()], close_after_reply=True) as srv:
            async with httpx.AsyncClient(transport=LeanAsyncTransport()) as client:
                await _post(client, srv.url, {})
                await asyncio.sleep(0.05)  # the server's FIN arrives while the connection is idle
                assert (await _post(client, srv.url, {})).status_code == 200
            assert srv.connections == 2

    asyncio.run(go())


def test_errors_map_to_httpx_exceptions():
    async def go():
        short = [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"]
        async with (
            RawServer(short, close_after_reply=True) as srv,
            httpx.AsyncClient(transport=LeanAsyncTransport()) as client,
        ):
            with pytest.raises(httpx.RemoteProtocolError):
                await _post(client, srv.url, {})
        async with RawServer([b"garbage\r\n\r\n"]) as srv, httpx.AsyncClient(transport=LeanAsyncTransport()) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await _post(client, srv.url, {})
        with socket_closed_port() as port:
            async with httpx.AsyncClient(transport=LeanAsyncTransport()) as client:
                with pytest.raises(httpx.ConnectError):
                    await client.get(f"http://127.0.0.1:{port}/health")

    asyncio.run(go())


@contextlib.asynccontextmanager
async def hung_server():
    """A loopback server that accepts connections and never answers; yields its port."""
    never = asyncio.Event()

    async def hang(reader, writer):
        await never.wait()

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        never.set()
        server.close()


def test_cancelled_request_does_not_return_its_connection():
    async def go():
        async with hung_server() as port:
            transport = LeanAsyncTransport()
            async with httpx.AsyncClient(transport=transport) as client:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await client.get(f"http://127.0.0.1:{port}/slow")
                assert not any(transport._idle.values())

    asyncio.run(go())


class socket_closed_port:
    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass


def test_post_bytes_frames_like_httpx_and_reuses_the_pool():
    """The direct path: same request bytes as a request through httpx.AsyncClient, same pool."""

    async def go():
        async with RawServer([ok(), ok(b'{"a": 2}'), ok(b"zz", b"Content-Type: text/plain\r\n")]) as srv:
            transport = LeanAsyncTransport()
            async with httpx.AsyncClient(transport=transport) as client:
                await _post(client, srv.url, {"n": 1})
                headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}  # as _post sends
                request = client.build_request("POST", srv.url + "/v1/x?q=1", headers=headers)
                head = transport.request_head(request)
                address = (request.url.host, request.url.port)
                assert await transport.post_bytes(address, head, b'{"n":1}') == (
                    200,
                    {b"content-length": b"8"},
                    b'{"a": 2}',
                )
                status, headers, body = await transport.post_bytes(address, head, b"")
                assert (status, headers[b"content-type"], body) == (200, b"text/plain", b"zz")
            assert srv.connections == 1
            assert srv.requests[0] == srv.requests[1]
            assert srv.requests[2].endswith(b"\r\nContent-Length: 0\r\n\r\n")

    asyncio.run(go())


def test_post_bytes_errors_map_to_httpx_exceptions():
    async def go():
        transport = LeanAsyncTransport()
        head = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        async with RawServer([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"], close_after_reply=True) as srv:
            address = ("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))
            with pytest.raises(httpx.RemoteProtocolError):
                await transport.post_bytes(address, head, b"{}")
        async with RawServer([b"garbage\r\n\r\n"]) as srv:
            with pytest.raises(httpx.RemoteProtocolError):
                await transport.post_bytes(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])), head, b"{}")
        with socket_closed_port() as port, pytest.raises(httpx.ConnectError):
            await transport.post_bytes(("127.0.0.1", port), head, b"{}")
        assert not any(transport._idle.values())
        await transport.aclose()

    asyncio.run(go())


def test_post_bytes_deadline_aborts_a_hung_exchange():
    async def go():
        transport = LeanAsyncTransport()
        async with hung_server() as port:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(httpx.ReadTimeout):
                await transport.post_bytes(("127.0.0.1", port), b"POST / HTTP/1.1\r\nHost: x\r\n", b"{}", timeout_s=0.2)
            assert 0.2 <= loop.time() - start < 1.0
            assert not any(transport._idle.values())
        async with RawServer([ok()]) as srv:  # in time: the timer is cancelled, the connection pooled
            address = ("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))
            status, _, _ = await transport.post_bytes(address, b"POST / HTTP/1.1\r\nHost: x\r\n", b"{}", timeout_s=5)
            assert status == 200 and len(transport._idle[address]) == 1
            await asyncio.sleep(0.01)
            assert transport._idle[address][0].usable()
        await transport.aclose()

    asyncio.run(go())
