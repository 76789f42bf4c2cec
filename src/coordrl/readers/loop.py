"""One asyncio event loop in a daemon thread, shared by every environment of a process.

Reader fleets hold HTTP connection pools, which bind to the event loop that created them. TRL runs
async tools on its own loop, the step API is synchronous, and evaluation has yet another loop; all
of them hand their reader calls to this loop, so one fleet (one pool) serves them all.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running forever in a daemon thread."""

    def __init__(self, name: str = "coordrl-readers") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it from synchronous code."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "BackgroundLoop.run called from its own thread would deadlock; await the coroutine instead"
            )
        return self.submit(coro).result(timeout)

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and await it from any other event loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        if self.loop.is_running():
            # Close the open async generators first, as asyncio.run does before closing its loop: the
            # HTTP connection pools of model clients are closed by theirs (see readers.chat_client).
            with contextlib.suppress(Exception):
                self.submit(self.loop.shutdown_asyncgens()).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


_shared: BackgroundLoop | None = None
_lock = threading.Lock()


def shared_loop() -> BackgroundLoop:
    """The process-wide background loop (created on first use)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = BackgroundLoop()
            atexit.register(_shared.close)
        return _shared
