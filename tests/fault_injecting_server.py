"""FaultInjectingFakeServer: a loopback OpenAI-compatible server used ONLY to inject latency and faults.

It is not a stand-in for a model: its answers are a trivial echo of the question. Tests and
benchmarks use it to exercise the client side (retries, timeouts, routing, concurrency bounds,
overhead) under conditions a real server cannot be made to produce on demand. Real-server
behaviour is covered by the vLLM CPU integration test.

A hand-written HTTP/1.1 loop on asyncio streams (keep-alive, Content-Length bodies) keeps it
dependency-free and fast enough to hold thousands of concurrent requests. It runs in a background
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
        self._conn_tasks: set[asyncio.Task] = set()

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
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conn_tasks):
            task.cancel()
        await asyncio.gather(*self._conn_tasks, return_exceptions=True)
        self._server = None

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conn_tasks.add(task)
        try:
            while await self._serve_one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conn_tasks.discard(task)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await reader.readexactly(length) if length else b""
        if path == "/health":
            return await self._reply(writer, 200, b"")
        if path == "/v1/models":
            return await self._reply(writer, 200, b'{"object": "list", "data": [{"id": "fake"}]}')
        if not (method == "POST" and path == "/v1/chat/completions"):
            return await self._reply(writer, 404, b'{"error": "not found"}')
        return await self._chat(writer, headers, body)

    async def _chat(self, writer: asyncio.StreamWriter, headers: dict[str, str], raw: bytes) -> bool:
        self.chat_requests += 1
        self.auth_headers.append(headers.get("authorization"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            with self._lock:
                fault = self._faults.popleft() if self._faults else self.fault_always
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            if fault == "hang":
                await asyncio.sleep(self.hang_s)
            if fault == "drop":
                return False
            if fault in ("500", "503", "429", "400"):
                return await self._reply(writer, int(fault), b'{"error": "injected fault"}')
            if fault == "bad_json":
                return await self._reply(writer, 200, b"{not json")
            body = json.loads(raw)
            self.models_seen.append(body.get("model"))
            reply = {
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.responder(body)}}],
            }
            return await self._reply(writer, 200, json.dumps(reply).encode())
        finally:
            self.in_flight -= 1

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, payload: bytes) -> bool:
        head = (
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + payload)
        await writer.drain()
        return True


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
