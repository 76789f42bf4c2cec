"""The HTTP side of every model-served chat role: OpenAI-compatible ``/v1/chat/completions`` replicas.

:class:`ChatCompletionsClient` is what the reader fleet (`OpenAIReaderFleet`) and the HMARS model
endpoints (`ChatEndpoint`) share: replica routing by a stable hash, one ``aiohttp`` session per
event loop whose connection pool is as large as the concurrency bound, the per-attempt deadline,
retries with backoff (:class:`~coordrl.readers.retry.RetryPolicy`), and the reading of a reply.
It never raises for a server failure: a request that fails after its retries comes back as
``ReaderResult(ok=False, error=...)``.

Why aiohttp: a training round sends thousands of small POSTs at once, so the client's CPU per
request is on the round's path. Measured in one run by ``benchmarks/reader_fanout.py`` (7,008
requests of 16.7 KB, a loopback server in another process), aiohttp costs 0.10-0.25 ms of client
CPU per request at concurrency 64 and 256, while ``httpx.AsyncClient`` on its default transport
costs 1.9-17 ms (its connection pool rescans every connection for every queued request). A
hand-written HTTP/1.1 client saved 0.05-0.16 ms per request more, immaterial against a GRPO step:
the figures and the arithmetic are in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import yarl

from coordrl.readers.base import ReaderResult
from coordrl.readers.meter import CallMeter
from coordrl.readers.prompt import READER_CHAT_TEMPLATE_KWARGS
from coordrl.readers.retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, Fatal, Retryable, RetryPolicy

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "DEFAULT_CONCURRENCY",
    "ChatCompletionsClient",
    "health",
    "normalize_base_url",
    "replica_index",
]

# Where a served role's API key is read from, and its requests in flight, unless its settings say otherwise.
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_CONCURRENCY = 64

# A thinking model that ignores enable_thinking may still emit a reasoning block; no caller wants it.
_THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)
_ERROR_BODY_CHARS = 200


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from ``http://host:port``, ``.../`` or ``.../v1`` (trailing parts dropped)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def replica_index(chunk_key: str, n_replicas: int) -> int:
    """The replica that serves ``chunk_key``: SHA-1 of the key modulo ``n_replicas``.

    Stable across processes and Python runs (unlike ``hash()``, which is salted per process).
    """
    digest = hashlib.sha1(chunk_key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % n_replicas


async def health(url: str, *, timeout_s: float = 5.0, session: aiohttp.ClientSession | None = None) -> bool:
    """True when the server at ``url`` answers ``GET /health`` (or, failing that, ``/v1/models``) with 200.

    Never raises; ``timeout_s`` (default 5 s) bounds each probe.
    """
    base = normalize_base_url(url)
    own = session is None
    http = session or aiohttp.ClientSession()
    try:
        for path in ("/health", "/v1/models"):
            try:
                async with http.get(base + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                    await response.read()
                    if response.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                return False  # unreachable: the second path would fail the same way
        return False
    finally:
        if own:
            await http.close()


class _Slots:
    """A FIFO concurrency limit, like ``asyncio.Semaphore`` but O(1) per release.

    Why not the semaphore: in Python 3.11 every release rescans the woken-but-not-yet-running
    waiters at the head of its queue, so when a few hundred replies land in one event-loop tick the
    releases cost time quadratic in their number. Here a release hands its slot straight to the
    oldest waiter still waiting and removes it (and any cancelled ones before it) from the queue.
    """

    __slots__ = ("_free", "_waiters")

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def __aenter__(self) -> None:
        if self._free > 0:
            self._free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():  # cancelled while queued: leave the queue
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            else:  # a slot was handed over but the task was cancelled before it ran: pass it on
                self._release()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a waiter cancelled but not yet run is still queued: skip it
                waiter.set_result(None)
                return
        self._free += 1


@dataclass
class _Flight:
    """A request in flight and how many callers wait for it."""

    task: asyncio.Future
    waiters: int = 0


class ChatCompletionsClient:
    """Chat completions from OpenAI-compatible replicas: routing, pooling, deadlines, retries.

    Args:
        urls: server base URLs (``http://host:port`` or ``https://...``, with or without ``/v1``),
            one per replica.
        model: the ``model`` field sent to the servers.
        api_key_env: environment variable read at request time for a Bearer token (default
            ``OPENAI_API_KEY``); unset or empty sends no Authorization header; None never sends one.
            The key is never stored on the client, logged or shown by ``repr``.
        max_concurrency: requests in flight at once, across all replicas (default 64); also the
            connection pool size.
        timeout_s: wall-clock limit of one attempt, connection included (default 60 s).
        max_retries: further attempts after the first on timeouts, connection errors, 5xx and 429
            (default 3); other 4xx and malformed replies fail at once.
        backoff_s: sleep before the first retry, doubled before each next one (default 0.5 s).
            A waiting request does not hold a concurrency slot.
        max_tokens: answer token budget (default 512).
        temperature: sampling temperature (default 0.0: the served roles are frozen and deterministic).
        extra_body: extra request fields merged last (e.g. ``{"top_p": 1.0}``); the default sends
            ``chat_template_kwargs={"enable_thinking": False}``.

    ``meter`` (default None) may be set to a :class:`~coordrl.readers.meter.CallMeter` to count the
    requests, their latencies and the time some request was in flight.

    ``coalesce`` (default True): while a request is in flight, an identical one (same replica, same
    body bytes) waits for its reply instead of being sent again, when decoding is greedy
    (``temperature`` 0, in the fields or ``extra_body``), so that both replies would be the same. The
    ``num_generations`` rollouts of a GRPO group often ask the same query of the same chunk in the
    same round: the server computes it once. Each caller still gets its own result (its own latency);
    the meter counts every call and how many were answered this way.
    """

    def __init__(
        self,
        urls: Sequence[str],
        model: str,
        *,
        api_key_env: str | None = DEFAULT_API_KEY_ENV,
        max_concurrency: int = DEFAULT_CONCURRENCY,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_RETRIES,
        backoff_s: float = 0.5,
        max_tokens: int = 512,
        temperature: float = 0.0,
        extra_body: Mapping[str, Any] | None = None,
        coalesce: bool = True,
    ) -> None:
        if not urls:
            raise ValueError(f"{type(self).__name__} needs at least one server URL")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be positive, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.urls = [normalize_base_url(u) for u in urls]
        self.model = model
        self.api_key_env = api_key_env
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.extra_body = dict(extra_body or {})
        self.coalesce = coalesce
        self._flights: dict[tuple[int, bytes], _Flight] = {}
        # Parsed once, not per request: a broadcast fans out to thousands of readers.
        self._endpoints = [yarl.URL(u + "/v1/chat/completions") for u in self.urls]
        # Created lazily: a session binds to the event loop that first uses it.
        self._session: aiohttp.ClientSession | None = None
        self._slots: _Slots | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._guard: AsyncGenerator[None, None] | None = None
        self.meter: CallMeter | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(urls={self.urls!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
            f"max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"
        )

    __str__ = __repr__

    # -- requests ---------------------------------------------------------------------------------

    def chat_body(self, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        """The JSON body of a chat request for ``messages`` (``role`` and ``content`` of each), with
        this client's sampling fields."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "chat_template_kwargs": dict(READER_CHAT_TEMPLATE_KWARGS),
        }
        body.update(self.extra_body)
        return body

    def route(self, key: str) -> str:
        """Base URL of the replica that serves ``key`` (see :func:`replica_index`)."""
        return self.urls[replica_index(key, len(self.urls))]

    @property
    def retry_policy(self) -> RetryPolicy:
        """The retries and backoff of every request (read per request: the fields may be changed)."""
        return RetryPolicy(self.max_retries, self.backoff_s)

    async def complete(self, key: str, payload: bytes) -> ReaderResult:
        """POST the encoded chat body ``payload`` to ``key``'s replica; the reply text, think block removed.

        Never raises for a server failure: after the retries the result has ``ok=False`` and the
        last error. An identical request already in flight answers this one too (``coalesce``).
        """
        session, slots = await self._ensure_session()
        n = len(self._endpoints)
        index = replica_index(key, n) if n > 1 else 0
        start = time.perf_counter()
        meter = self.meter
        if meter is not None:
            meter.begin()
        outcome, joined = None, False
        try:
            if self.coalesce and self._greedy():
                outcome, joined = await self._shared_post(index, payload, session, slots)
            else:
                outcome = await self._post(index, payload, session, slots)
        finally:
            latency = time.perf_counter() - start
            if meter is not None:  # a cancelled request leaves the in-flight count too
                meter.end(latency, ok=outcome is not None and outcome.ok, coalesced=joined)
        if not outcome.ok:
            return ReaderResult(text="", ok=False, error=outcome.error, latency_s=latency, attempts=outcome.attempts)
        text = _THINK_BLOCK.sub("", outcome.value or "", count=1).strip()
        return ReaderResult(text=text, latency_s=latency, attempts=outcome.attempts)

    def _greedy(self) -> bool:
        """Whether every request is decoded greedily, so identical requests get identical replies."""
        return self.extra_body.get("temperature", self.temperature) == 0

    async def _post(self, index: int, payload: bytes, session: aiohttp.ClientSession, slots: _Slots):
        """The request with its retries: the retry policy's outcome."""
        endpoint = self._endpoints[index]
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)

        async def attempt() -> str:
            async with slots:  # held for the attempt only, not for the backoff before a retry
                return await self._attempt(session, endpoint, payload, timeout)

        return await self.retry_policy.arun(attempt)

    async def _shared_post(self, index: int, payload: bytes, session: aiohttp.ClientSession, slots: _Slots):
        """:meth:`_post`, joined to an identical request in flight if there is one: ``(outcome, joined)``.

        The request runs as a task that its callers await through ``asyncio.shield``, so a cancelled
        caller does not cancel it for the others; when the last caller is cancelled the task is
        cancelled too and forgotten, so no request outlives everyone who asked for it.
        """
        key = (index, payload)
        flight = self._flights.get(key)
        joined = flight is not None
        if flight is None:
            flight = _Flight(asyncio.ensure_future(self._post(index, payload, session, slots)))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda _task: self._forget(key, flight))
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task), joined
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()
                self._forget(key, flight)

    def _forget(self, key: tuple[int, bytes], flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]

    async def _attempt(
        self, session: aiohttp.ClientSession, endpoint: yarl.URL, payload: bytes, timeout: aiohttp.ClientTimeout
    ) -> str:
        """One attempt: the reply text, or :class:`Retryable` / :class:`Fatal` with the error to report."""
        try:
            async with session.post(endpoint, data=payload, headers=self._headers(), timeout=timeout) as response:
                content = await response.read()
                return _reply_text(response.status, content, lambda: _decoded(response, content))
        except (Retryable, Fatal):
            raise
        except TimeoutError as exc:  # aiohttp's deadline errors are TimeoutErrors too
            raise Retryable(f"timeout after {self.timeout_s}s") from exc
        except aiohttp.ClientError as exc:  # refused, reset, dropped, protocol error, ...
            raise Retryable(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # a failed request must never end the episode
            raise Fatal(f"unexpected {type(exc).__name__}: {exc}") from exc

    def _headers(self) -> dict[str, str] | None:
        # Read at request time and never stored, so that no attribute holds the key. Checked as
        # ASCII here because aiohttp would send any other header value as UTF-8 bytes.
        key = (os.environ.get(self.api_key_env) or None) if self.api_key_env else None
        if not key:
            return None
        value = f"Bearer {key}"
        value.encode("ascii")
        return {"Authorization": value}

    # -- plumbing ---------------------------------------------------------------------------------

    async def _ensure_session(self) -> tuple[aiohttp.ClientSession, _Slots]:
        loop = asyncio.get_running_loop()
        if self._session is not None and self._slots is not None and self._loop is loop:
            return self._session, self._slots
        # First use, or a caller that runs each batch under its own asyncio.run(): a fresh pool for
        # this loop. The previous one (if any) is closed by its guard on its own loop.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_concurrency, limit_per_host=0),
            headers={"Content-Type": "application/json"},
        )
        self._session, self._slots, self._loop = session, _Slots(self.max_concurrency), loop
        self._guard = _closed_with_its_loop(session)
        await anext(self._guard)
        return session, self._slots

    async def health(self) -> dict[str, bool]:
        """Health of every replica, by base URL (see :func:`health`)."""
        session, _ = await self._ensure_session()
        results = await asyncio.gather(*(health(u, session=session) for u in self.urls))
        return dict(zip(self.urls, results))

    async def aclose(self) -> None:
        """Close the connection pool. The client can be used again afterwards (a new pool is made)."""
        if self._session is not None and self._guard is not None and self._loop is asyncio.get_running_loop():
            await self._guard.aclose()  # closes the session
        # A pool made on another loop is left to its guard, which closes it on that loop.
        self._session = None
        self._slots = None
        self._loop = None
        self._guard = None

    async def __aenter__(self) -> ChatCompletionsClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def _closed_with_its_loop(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Closes ``session`` when this generator is closed: by :meth:`ChatCompletionsClient.aclose`, by its
    event loop shutting down its async generators (``asyncio.run`` does so before closing the loop),
    or by the loop's finaliser when the generator is garbage collected.

    Why: a pool binds to one loop and can only be closed on it. A caller that runs batches under
    separate ``asyncio.run()`` calls never gets to close the previous loop's pool, and aiohttp logs
    an error for every session and connector collected unclosed.
    """
    try:
        yield
    finally:
        await session.close()


def _reply_text(status: int, content: bytes, text: Callable[[], str]) -> str:
    """The answer in a chat reply, or Retryable / Fatal by status; ``text()`` (the decoded body,
    only needed for error messages) is called on failures only."""
    if status == 429 or status >= 500:
        raise Retryable(f"HTTP {status}: {text()[:_ERROR_BODY_CHARS]}")
    if status != 200:
        raise Fatal(f"HTTP {status}: {text()[:_ERROR_BODY_CHARS]}")
    try:
        answer = json.loads(content)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise Fatal(f"malformed reply: {text()[:_ERROR_BODY_CHARS]}") from exc
    return answer if isinstance(answer, str) else ""


def _decoded(response: aiohttp.ClientResponse, content: bytes) -> str:
    """``content`` as text in the response's charset (UTF-8 when it names none or an unknown one)."""
    encoding = response.charset or "utf-8"
    try:
        codecs.lookup(encoding)
    except LookupError:
        encoding = "utf-8"
    return content.decode(encoding, errors="replace")
