"""FaultInjectingFakeServer: a loopback OpenAI-compatible server used ONLY to inject latency and faults.

It is not a stand-in for a model: its answers are a trivial echo of the question. Tests and
benchmarks use it to exercise the client side (retries, timeouts, routing, concurrency bounds,
overhead) under conditions a real server cannot be made to produce on demand. Real-server
behaviour is covered by the vLLM CPU integration test.

A hand-written HTTP/1.1 asyncio Protocol (keep-alive, Content-Length bodies, replies scheduled with
``call_later``) keeps it dependency-free and cheap per request (a few microseconds beyond parsing the
body), so thousands of concurrent requests cost the client under test little shared CPU. It runs in a background
thread with its own event loop, or as a separate process (``python fault_injecting_server.py
--latency 0.05``; prints ``PORT <n>``), so the client under test never shares its loop.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import threading
from collections.abc import Callable
from typing import Any

FAULTS = ("500", "503", "429", "400", "hang", "drop", "bad_json")


def echo_answer(body: dict[str, Any]) -> str:
    """Default reply: ``Answer: <the question of the last user message>``."""
    content = body["messages"][-1]["content"]
    return "Answer: " + content.rsplit("Question: ", 1)[-1]


class FaultInjectingFakeServer:
    """Loopback fake of ``/v1/chat/completions``, ``/health`` and ``/v1/models`` for fault injection.

    Args:
        latency_s: delay before each chat reply (default 0).
        port: port to bind, 0 for a free one (default); kept across stop()/start().
        hang_s: how long a ``"hang"`` fault waits before replying (default 30 s).
        responder: reply text for a request body (default :func:`echo_answer`).

    Faults, consumed one per chat request from :meth:`fail_next`, or applied to every request with
    :attr:`fault_always`: ``"500"``/``"503"``/``"429"``/``"400"`` (that status), ``"hang"`` (no reply
    for ``hang_s``), ``"drop"`` (close the connection without replying), ``"bad_json"``.
    Counters: ``chat_requests``, ``in_flight``, ``max_in_flight``, ``auth_headers`` (one per chat
    request, None when absent), ``models_seen``.
    """

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        port: int = 0,
        hang_s: float = 30.0,
        responder: Callable[[dict[str, Any]], str] = echo_answer,
        host: str = "127.0.0.1",
    ) -> None:
        self.latency_s = latency_s
        self.port = port
        self.host = host
        self.hang_s = hang_s
        self.responder = responder
        self.fault_always: str | None = None
        self._faults: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self.reset_counters()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Connection] = set()

    # -- control (any thread) ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset_counters(self) -> None:
        self.chat_requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.auth_headers: list[str | None] = []
        self.models_seen: list[str] = []

    def fail_next(self, *faults: str) -> None:
        """Queue faults for the next chat requests, one each, in order."""
        for fault in faults:
            if fault not in FAULTS:
                raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
        with self._lock:
            self._faults.extend(faults)

    def start(self) -> FaultInjectingFakeServer:
        """Start serving in a background thread (same port as before after a stop)."""
        if self._thread is not None:
            raise RuntimeError("already running")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection (clients then see refused connections)."""
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop, self._thread = None, None

    def __enter__(self) -> FaultInjectingFakeServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- serving (server loop) --------------------------------------------------------------------

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.abort()
        self._server = None

    def _request(self, conn: _Connection, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        """Handle one parsed request; the reply goes out through ``conn.reply`` now or after the latency."""
        if path == "/health":
            return conn.reply(200, b"")
        if path == "/v1/models":
            return conn.reply(200, b'{"object": "list", "data": [{"id": "fake"}]}')
        if not (method == "POST" and path == "/v1/chat/completions"):
            return conn.reply(404, b'{"error": "not found"}')
        self.chat_requests += 1
        self.auth_headers.append(headers.get("authorization"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        with self._lock:
            fault = self._faults.popleft() if self._faults else self.fault_always
        delay = self.latency_s + (self.hang_s if fault == "hang" else 0.0)
        if delay > 0:
            conn.later(delay, self._chat_reply, conn, fault, body)
        else:
            self._chat_reply(conn, fault, body)

    def _chat_reply(self, conn: _Connection, fault: str | None, raw: bytes) -> None:
        self.in_flight -= 1
        if fault == "drop":
            return conn.abort()
        if fault in ("500", "503", "429", "400"):
            return conn.reply(int(fault), b'{"error": "injected fault"}')
        if fault == "bad_json":
            return conn.reply(200, b"{not json")
        body = json.loads(raw)
        self.models_seen.append(body.get("model"))
        reply = {
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.responder(body)}}],
        }
        conn.reply(200, json.dumps(reply).encode())


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection. A Protocol rather than asyncio streams: no task, reader or
    drain per request, so the server spends a few microseconds per request instead of ~80 and a
    benchmark of the client measures the client. Requests on one connection are answered in order."""

    def __init__(self, server: FaultInjectingFakeServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._conns.discard(self)
        self.transport = None
        if self.timer is not None:  # a reply that will never be sent is no longer in flight
            self.timer.cancel()
            self.timer = None
            self.server.in_flight -= 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        while not self.busy and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            method, path, _ = lines[0].split(" ", 2)
            self.busy = True
            self.server._request(self, method, path, headers, body)

    def later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        def fire() -> None:
            self.timer = None
            fn(*args)

        self.timer = asyncio.get_running_loop().call_later(delay, fire)

    def reply(self, status: int, payload: bytes) -> None:
        if self.transport is None:
            return
        head = (
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n"
        )
        self.transport.write(head.encode("latin-1") + payload)
        self.busy = False
        self._next()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0)
    args = parser.parse_args()
    server = FaultInjectingFakeServer(latency_s=args.latency, port=args.port).start()
    print(f"PORT {server.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
