"""A reader fleet served by OpenAI-compatible chat servers (vLLM replicas, or a hosted API).

One connection pool is shared by every request, with as many connections as the concurrency
bound, so a broadcast of thousands of reader calls costs little more than the server time. For
``http://`` servers the pool is a :class:`~coordrl.readers.http_transport.LeanAsyncTransport`
(httpx's default transport costs milliseconds per call at a few hundred connections, see there),
and chat requests skip ``httpx.AsyncClient`` too: their head is serialised once per replica and
sent with :meth:`~coordrl.readers.http_transport.LeanAsyncTransport.post_bytes`, because building
httpx's request and response objects was most of the client's remaining CPU per call. ``https://``
servers, a caller-given ``transport`` and the health probes go through ``httpx.AsyncClient``. Each
chunk is pinned to one replica by a stable hash of its ``chunk_key``: every query to a chunk lands
where that chunk's prefix is already cached.

Failures never raise: after the retry budget a request comes back as
``ReaderResult(ok=False, error=...)`` so that an episode can go on without that reader.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from coordrl.readers.base import ReaderRequest, ReaderResult
from coordrl.readers.http_transport import Address, LeanAsyncTransport
from coordrl.readers.prompt import (
    READER_CHAT_TEMPLATE_KWARGS,
    reader_messages,
    sanitize_reader_text,
)

__all__ = ["OpenAIReaderFleet", "health", "normalize_base_url", "replica_index"]

logger = logging.getLogger(__name__)

# A thinking model that ignores enable_thinking may still emit a reasoning block; the lead agent
# must only see the answer.
_THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)
_ERROR_BODY_CHARS = 200
_HEAD_CACHE_ENTRIES = 4096
_START_BATCH = 32  # requests set up per event-loop turn when a batch starts


# What json.dumps writes as \uXXXX, \b or \f: every control character but tab, LF and CR, and DEL.
_RARE_ESCAPES = bytes(c for c in [*range(0x20), 0x7F] if c not in b"\t\n\r")


def _json_string(text: str) -> bytes:
    """``json.dumps(text).encode()``, byte for byte, in about a third of the time for plain ASCII text.

    A broadcast's first query to each chunk JSON-escapes the whole passage, on the path of the
    first wave of requests. An ASCII passage whose only characters to escape are ``\\``, ``"``,
    newlines, carriage returns and tabs is escaped with ``bytes.replace``, which scans at memory
    speed; any other text goes to ``json.dumps``.
    """
    if text.isascii():
        raw = text.encode("ascii")
        if len(raw.translate(None, _RARE_ESCAPES)) == len(raw):
            escaped = (
                raw.replace(b"\\", b"\\\\").replace(b'"', b'\\"')
                .replace(b"\n", b"\\n").replace(b"\r", b"\\r").replace(b"\t", b"\\t")
            )  # fmt: skip
            return b'"' + escaped + b'"'
    return json.dumps(text).encode()


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


async def health(url: str, *, timeout_s: float = 5.0, client: httpx.AsyncClient | None = None) -> bool:
    """True when the server at ``url`` answers ``GET /health`` (or, failing that, ``/v1/models``) with 200.

    Never raises; ``timeout_s`` (default 5 s) bounds each probe.
    """
    base = normalize_base_url(url)
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout_s)
    try:
        for path in ("/health", "/v1/models"):
            try:
                response = await http.get(base + path, timeout=timeout_s)
            except httpx.HTTPError:
                return False  # unreachable: the second path would fail the same way
            if response.status_code == 200:
                return True
        return False
    finally:
        if own:
            await http.aclose()


class _Retryable(Exception):
    """An attempt failed in a way that another attempt may fix."""


class _Fatal(Exception):
    """An attempt failed in a way that retrying cannot fix."""


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


class OpenAIReaderFleet:
    """:class:`~coordrl.readers.base.ReaderFleet` over OpenAI-compatible ``/v1/chat/completions``.

    Args:
        urls: server base URLs (``http://host:port``, with or without ``/v1``), one per replica.
        model: the ``model`` field sent to the servers.
        api_key_env: environment variable read at request time for a Bearer token (default
            ``OPENAI_API_KEY``); unset or empty sends no Authorization header; None never sends one.
            The key is never stored on the fleet, logged or shown by ``repr``.
        max_concurrency: requests in flight at once, across all replicas (default 64); also the
            connection pool size.
        timeout_s: wall-clock limit of one attempt, connection included (default 60 s).
        max_retries: further attempts after the first on timeouts, connection errors, 5xx and 429
            (default 3); other 4xx and malformed replies fail at once.
        backoff_s: sleep before the first retry, doubled before each next one (default 0.5 s).
            A waiting request does not hold a concurrency slot.
        max_tokens: answer token budget (default 512).
        temperature: sampling temperature (default 0.0: readers are frozen and deterministic).
        extra_body: extra request fields merged last (e.g. ``{"top_p": 1.0}``); the default sends
            ``chat_template_kwargs={"enable_thinking": False}``.
        transport: the httpx transport; default :class:`LeanAsyncTransport` (``https`` URLs go
            through httpx's own transport). Pass ``httpx.AsyncHTTPTransport(...)`` to use httpx's.
    """

    def __init__(
        self,
        urls: Sequence[str],
        model: str,
        *,
        api_key_env: str | None = "OPENAI_API_KEY",
        max_concurrency: int = 64,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_tokens: int = 512,
        temperature: float = 0.0,
        extra_body: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not urls:
            raise ValueError("OpenAIReaderFleet needs at least one server URL")
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
        self._transport_override = transport
        # Parsed once: httpx re-parses a string URL on every request, a measurable share of the
        # client's per-call CPU when a broadcast fans out to thousands of readers.
        self._endpoints = [httpx.URL(u + "/v1/chat/completions") for u in self.urls]
        # Created lazily: an AsyncClient binds to the event loop that first uses it.
        self._heads: dict[
            tuple[str, str], bytes
        ] = {}  # (chunk_key, text) -> body up to the question; insertion-ordered
        self._client: httpx.AsyncClient | None = None
        self._semaphore: _Slots | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The fleet's own LeanAsyncTransport, and per endpoint its (address, request head without
        # Authorization) when chat requests bypass httpx.AsyncClient, else None; made with the client.
        self._lean: LeanAsyncTransport | None = None
        self._direct: list[tuple[Address, bytes] | None] = []

    def __repr__(self) -> str:
        return (
            f"OpenAIReaderFleet(urls={self.urls!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
            f"max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"
        )

    __str__ = __repr__

    # -- plumbing ---------------------------------------------------------------------------------

    def _ensure_client(self) -> tuple[httpx.AsyncClient, _Slots]:
        loop = asyncio.get_running_loop()
        # A caller that runs each batch under its own asyncio.run() gets a fresh pool per loop: the
        # old one belongs to a closed loop and cannot even be closed from here.
        if self._client is None or self._semaphore is None or self._loop is not loop:
            self._loop = loop
            lean = None if self._transport_override else LeanAsyncTransport(max_idle_per_host=self.max_concurrency)
            transport = self._transport_override or lean
            # Per-attempt deadlines cover the whole exchange (asyncio.timeout here, the lean
            # transport's timer on the direct path); httpx's own timeouts are per read/write and
            # only a backstop here.
            self._client = httpx.AsyncClient(
                transport=transport, timeout=httpx.Timeout(self.timeout_s), headers={"Content-Type": "application/json"}
            )
            self._semaphore = _Slots(self.max_concurrency)
            self._lean = lean
            # The head comes from the client itself, so the direct path sends exactly the bytes that
            # client.post() through the same transport would (client default headers included).
            self._direct = [
                ((e.host, e.port or 80), lean.request_head(self._client.build_request("POST", e)))
                if lean is not None and e.scheme == "http"
                else None
                for e in self._endpoints
            ]
        return self._client, self._semaphore

    def route(self, chunk_key: str) -> str:
        """Base URL of the replica that serves ``chunk_key`` (see :func:`replica_index`)."""
        return self.urls[replica_index(chunk_key, len(self.urls))]

    def _api_key(self) -> str | None:
        # Read at request time and never stored, so that no attribute of the fleet holds it.
        return (os.environ.get(self.api_key_env) or None) if self.api_key_env else None

    def _headers(self) -> dict[str, str] | None:
        # Content-Type is a client default; only the key is per call.
        key = self._api_key()
        return {"Authorization": f"Bearer {key}"} if key else None

    def request_body(self, request: ReaderRequest) -> dict[str, Any]:
        """The JSON body sent for ``request``: the one place where a request's body is defined.

        Messages come from :meth:`ReaderRequest.chat_messages` (the reader prompt of
        :func:`reader_messages`, or the request's own messages for every other role). A subclass may
        override this; :meth:`encode_body` then sends exactly what the override returns.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": request.chat_messages(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "chat_template_kwargs": dict(READER_CHAT_TEMPLATE_KWARGS),
        }
        body.update(self.extra_body)
        return body

    def encode_body(self, request: ReaderRequest) -> bytes:
        """``json.dumps(request_body(request))`` (compact), byte for byte, for every request kind.

        Reader requests take a fast path with the costly part cached: a broadcast sends every query
        to every chunk, so the sanitised, JSON-escaped passage is encoded once per chunk and reused
        (JSON escaping is per character, so an escaped prefix and an escaped suffix concatenate into
        the escaped whole). Every other request (own messages, a subclass's ``request_body``,
        ``extra_body`` that replaces the model or messages) is encoded from :meth:`request_body`.
        """
        return self._encode_body(request, None)

    def _fast_path(self, request: ReaderRequest) -> bool:
        """Whether :meth:`_encode_body`'s cached layout is exactly what :meth:`request_body` builds."""
        return (
            request.messages is None
            and type(self).request_body is OpenAIReaderFleet.request_body
            and type(request).chat_messages is ReaderRequest.chat_messages
            and "model" not in self.extra_body
            and "messages" not in self.extra_body
        )

    def _encode_body(self, request: ReaderRequest, tails: dict[str, bytes] | None) -> bytes:
        """:meth:`encode_body`, with the part after the passage looked up in ``tails`` by query.

        ``tails`` lives for one :meth:`answer` batch (whose queries each go to every chunk), so the
        question and the sampling fields are encoded once per query and batch, and fields changed
        on the fleet between batches still take effect.
        """
        if not self._fast_path(request):
            return json.dumps(self.request_body(request), separators=(",", ":")).encode()
        head = self._heads.get((request.chunk_key, request.chunk_text))
        if head is None:
            messages = reader_messages(request.chunk_text, "")
            system, user = messages[0]["content"], messages[1]["content"]
            head = b"".join((
                b'{"model":', json.dumps(self.model).encode(),
                b',"messages":[{"role":"system","content":', json.dumps(system).encode(),
                b'},{"role":"user","content":', _json_string(user)[:-1],  # the user string stays open
            ))  # fmt: skip
            self._heads[(request.chunk_key, request.chunk_text)] = head
            if len(self._heads) > _HEAD_CACHE_ENTRIES:
                self._heads.pop(next(iter(self._heads)))
        tail = tails.get(request.query) if tails is not None else None
        if tail is None:
            question = sanitize_reader_text(request.query.strip())
            rest = {
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                "chat_template_kwargs": dict(READER_CHAT_TEMPLATE_KWARGS),
            }
            rest.update(self.extra_body)
            tail = (json.dumps(question)[1:] + "}]," + json.dumps(rest, separators=(",", ":"))[1:]).encode()
            if tails is not None:
                tails[request.query] = tail
        return head + tail

    async def _attempt(self, client: httpx.AsyncClient, endpoint: httpx.URL, payload: bytes) -> str:
        """One attempt through ``httpx.AsyncClient`` (https, or a caller-given transport)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await client.post(endpoint, content=payload, headers=self._headers())
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise _Retryable(f"timeout after {self.timeout_s}s") from exc
        except httpx.TransportError as exc:  # refused, reset, protocol error, ...
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        return _reply_text(response.status_code, response.content, lambda: response.text)

    async def _attempt_direct(self, lean: LeanAsyncTransport, route: tuple[Address, bytes], payload: bytes) -> str:
        """One attempt on the lean transport's pool, bypassing httpx.AsyncClient (see the module doc).

        Same bytes on the wire, same deadline (enforced by the transport's timer rather than
        ``asyncio.timeout``, see :meth:`LeanAsyncTransport.post_bytes`) and same failure classes
        as :meth:`_attempt`.
        """
        address, head = route
        key = self._api_key()
        if key:  # encoded as httpx encodes header values (ASCII), so a bad key fails the same way
            head = b"%sAuthorization: %s\r\n" % (head, f"Bearer {key}".encode("ascii"))
        try:
            status, headers, content = await lean.post_bytes(address, head, payload, self.timeout_s)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise _Retryable(f"timeout after {self.timeout_s}s") from exc
        except httpx.TransportError as exc:  # refused, reset, protocol error, ...
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        return _reply_text(status, content, lambda: _decoded_text(status, headers, content))

    async def _answer_one(self, request: ReaderRequest, tails: dict[str, bytes]) -> ReaderResult:
        client, semaphore = self._ensure_client()
        n_endpoints = len(self._endpoints)
        index = replica_index(request.chunk_key, n_endpoints) if n_endpoints > 1 else 0
        endpoint = self._endpoints[index]
        direct = self._direct[index]
        lean = self._lean
        payload = self._encode_body(request, tails)  # once for all attempts
        start = time.perf_counter()
        error = "no attempt made"
        attempts = 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            attempts += 1
            try:
                async with semaphore:
                    if direct is not None and lean is not None:
                        text = await self._attempt_direct(lean, direct, payload)
                    else:
                        text = await self._attempt(client, endpoint, payload)
            except _Retryable as exc:
                error = str(exc)
                continue
            except _Fatal as exc:
                error = str(exc)
                break
            except Exception as exc:  # a reader failure must never end the episode
                error = f"unexpected {type(exc).__name__}: {exc}"
                break
            text = _THINK_BLOCK.sub("", text, count=1).strip()
            if request.messages is None:
                # A reader's answer goes to the policy as a finding: neutralised here. Other roles'
                # replies are parsed first (a selector's JSON, the answer model's <answer> tag) and
                # their callers neutralise what they pass on.
                text = sanitize_reader_text(text)
            return ReaderResult(text=text, latency_s=time.perf_counter() - start, attempts=attempts)
        logger.debug("reader request to %s failed after %d attempt(s): %s", endpoint, attempts, error)
        return ReaderResult(text="", ok=False, error=error, latency_s=time.perf_counter() - start, attempts=attempts)

    # -- ReaderFleet ------------------------------------------------------------------------------

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]:
        """Answer every request concurrently (at most ``max_concurrency`` in flight), in request order."""
        if not requests:
            return []
        tails: dict[str, bytes] = {}  # query -> encoded body after the passage, for this batch
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[ReaderResult]] = []
        try:
            for i, request in enumerate(requests, 1):
                tasks.append(loop.create_task(self._answer_one(request, tails)))
                if i % _START_BATCH == 0:
                    # Tasks start in creation order either way; yielding lets the first requests go
                    # out while the rest of a large broadcast is still being set up.
                    await asyncio.sleep(0)
            results = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # cancelled (or failed) part way: leave no request running
                task.cancel()
            raise
        failed = [r for r in results if not r.ok]
        if failed:
            # One line per batch: an outage must not print a warning per reader.
            logger.warning(
                "%d of %d reader requests failed; first error: %s", len(failed), len(results), failed[0].error
            )
        return results

    async def health(self) -> dict[str, bool]:
        """Health of every replica, by base URL (see :func:`health`)."""
        client, _ = self._ensure_client()
        results = await asyncio.gather(*(health(u, client=client) for u in self.urls))
        return dict(zip(self.urls, results))

    async def aclose(self) -> None:
        """Close the connection pool. The fleet can be used again afterwards (a new pool is made)."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()  # closes the lean transport's pool too
        self._client = None
        self._semaphore = None
        self._loop = None
        self._lean = None
        self._direct = []

    async def __aenter__(self) -> OpenAIReaderFleet:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _reply_text(status: int, content: bytes, text: Callable[[], str]) -> str:
    """The answer in a chat reply, or _Retryable / _Fatal by status; ``text()`` (the decoded body,
    only needed for error messages) is called on failures only."""
    if status == 429 or status >= 500:
        raise _Retryable(f"HTTP {status}: {text()[:_ERROR_BODY_CHARS]}")
    if status != 200:
        raise _Fatal(f"HTTP {status}: {text()[:_ERROR_BODY_CHARS]}")
    try:
        answer = json.loads(content)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _Fatal(f"malformed reply: {text()[:_ERROR_BODY_CHARS]}") from exc
    return answer if isinstance(answer, str) else ""


def _decoded_text(status: int, headers: Mapping[bytes, bytes], content: bytes) -> str:
    """``content`` as text, with the charset rules of ``httpx.Response.text`` (error path only)."""
    content_type = headers.get(b"content-type")
    return httpx.Response(
        status, headers={b"content-type": content_type} if content_type else None, content=content
    ).text
