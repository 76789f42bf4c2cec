"""A reader fleet served by OpenAI-compatible chat servers (vLLM replicas, or a hosted API).

One ``httpx.AsyncClient`` is shared by every request, with as many connections as the
concurrency bound, so a broadcast of thousands of reader calls costs little more than the server
time. For ``http://`` servers the client runs on
:class:`~coordrl.rollout.http_transport.LeanAsyncTransport`: httpx's default transport costs
milliseconds per call at a few hundred connections (see there). Each chunk is pinned to one
replica by a stable hash of its ``chunk_key``: every query to a chunk lands where that chunk's
prefix is already cached.

Failures never raise: after the retry budget a request comes back as
``ReaderResult(ok=False, error=...)`` so that an episode can go on without that reader.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from coordrl.rollout.http_transport import LeanAsyncTransport
from coordrl.rollout.reader_prompt import READER_CHAT_TEMPLATE_KWARGS, reader_messages, sanitize_reader_text
from coordrl.rollout.readers_base import ReaderRequest, ReaderResult

__all__ = ["OpenAIReaderFleet", "health", "normalize_base_url", "replica_index"]

logger = logging.getLogger(__name__)

# A thinking model that ignores enable_thinking may still emit a reasoning block; the lead agent
# must only see the answer.
_THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)
_ERROR_BODY_CHARS = 200
_HEAD_CACHE_ENTRIES = 4096


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


class OpenAIReaderFleet:
    """:class:`~coordrl.rollout.readers_base.ReaderFleet` over OpenAI-compatible ``/v1/chat/completions``.

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
        self._heads: dict[tuple[str, str], bytes] = {}  # (chunk_key, text) -> body up to the question; insertion-ordered
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return (
            f"OpenAIReaderFleet(urls={self.urls!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
            f"max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"
        )

    __str__ = __repr__

    # -- plumbing ---------------------------------------------------------------------------------

    def _ensure_client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        # A caller that runs each batch under its own asyncio.run() gets a fresh pool per loop: the
        # old one belongs to a closed loop and cannot even be closed from here.
        if self._client is None or self._semaphore is None or self._loop is not loop:
            self._loop = loop
            transport = self._transport_override or LeanAsyncTransport(max_idle_per_host=self.max_concurrency)
            # Per-attempt deadlines are enforced with asyncio.timeout, which covers the whole
            # exchange; httpx's own timeouts are per read/write and only a backstop here.
            self._client = httpx.AsyncClient(
                transport=transport, timeout=httpx.Timeout(self.timeout_s), headers={"Content-Type": "application/json"}
            )
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._client, self._semaphore

    def route(self, chunk_key: str) -> str:
        """Base URL of the replica that serves ``chunk_key`` (see :func:`replica_index`)."""
        return self.urls[replica_index(chunk_key, len(self.urls))]

    def _headers(self) -> dict[str, str] | None:
        # Content-Type is a client default; only the key (read at request time, never stored) is per call.
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else None

    def encode_body(self, request: ReaderRequest) -> bytes:
        """``json.dumps(request_body(request))`` (compact), byte for byte, with the costly part cached.

        A broadcast sends every query to every chunk, so the sanitised, JSON-escaped passage is
        encoded once per chunk and reused (JSON escaping is per character, so an escaped prefix
        and an escaped suffix concatenate into the escaped whole).
        """
        if "model" in self.extra_body or "messages" in self.extra_body:
            return json.dumps(self.request_body(request), separators=(",", ":")).encode()
        head = self._heads.get((request.chunk_key, request.chunk_text))
        if head is None:
            messages = reader_messages(request.chunk_text, "")
            system, user = messages[0]["content"], messages[1]["content"]
            head = (
                '{"model":' + json.dumps(self.model)
                + ',"messages":[{"role":"system","content":' + json.dumps(system)
                + '},{"role":"user","content":' + json.dumps(user)[:-1]  # the user string stays open
            ).encode()  # fmt: skip
            self._heads[(request.chunk_key, request.chunk_text)] = head
            if len(self._heads) > _HEAD_CACHE_ENTRIES:
                self._heads.pop(next(iter(self._heads)))
        question = sanitize_reader_text(request.query.strip())
        rest = {"max_tokens": self.max_tokens, "temperature": self.temperature, "chat_template_kwargs": dict(READER_CHAT_TEMPLATE_KWARGS)}
        rest.update(self.extra_body)
        return head + (json.dumps(question)[1:] + "}]," + json.dumps(rest, separators=(",", ":"))[1:]).encode()

    def request_body(self, request: ReaderRequest) -> dict[str, Any]:
        """The JSON body sent for ``request`` (prompt from :func:`reader_messages`)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": reader_messages(request.chunk_text, request.query),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "chat_template_kwargs": dict(READER_CHAT_TEMPLATE_KWARGS),
        }
        body.update(self.extra_body)
        return body

    async def _attempt(self, client: httpx.AsyncClient, endpoint: httpx.URL, payload: bytes) -> str:
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await client.post(endpoint, content=payload, headers=self._headers())
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise _Retryable(f"timeout after {self.timeout_s}s") from exc
        except httpx.TransportError as exc:  # refused, reset, protocol error, ...
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status == 429 or status >= 500:
            raise _Retryable(f"HTTP {status}: {response.text[:_ERROR_BODY_CHARS]}")
        if status != 200:
            raise _Fatal(f"HTTP {status}: {response.text[:_ERROR_BODY_CHARS]}")
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _Fatal(f"malformed reply: {response.text[:_ERROR_BODY_CHARS]}") from exc
        return content if isinstance(content, str) else ""

    async def _answer_one(self, request: ReaderRequest) -> ReaderResult:
        client, semaphore = self._ensure_client()
        endpoint = self._endpoints[replica_index(request.chunk_key, len(self._endpoints))]
        # Encoded once for all attempts; ASCII escaping is the fastest path of the json C encoder.
        payload = self.encode_body(request)
        start = time.perf_counter()
        error = "no attempt made"
        attempts = 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            attempts += 1
            try:
                async with semaphore:
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
            text = sanitize_reader_text(_THINK_BLOCK.sub("", text, count=1).strip())
            return ReaderResult(text=text, latency_s=time.perf_counter() - start, attempts=attempts)
        logger.debug("reader request to %s failed after %d attempt(s): %s", endpoint, attempts, error)
        return ReaderResult(
            text="", ok=False, error=error, latency_s=time.perf_counter() - start, attempts=attempts
        )

    # -- ReaderFleet ------------------------------------------------------------------------------

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]:
        """Answer every request concurrently (at most ``max_concurrency`` in flight), in request order."""
        if not requests:
            return []
        results = list(await asyncio.gather(*(self._answer_one(r) for r in requests)))
        failed = [r for r in results if not r.ok]
        if failed:
            # One line per batch: an outage must not print a warning per reader.
            logger.warning("%d of %d reader requests failed; first error: %s", len(failed), len(results), failed[0].error)
        return results

    async def health(self) -> dict[str, bool]:
        """Health of every replica, by base URL (see :func:`health`)."""
        client, _ = self._ensure_client()
        results = await asyncio.gather(*(health(u, client=client) for u in self.urls))
        return dict(zip(self.urls, results))

    async def aclose(self) -> None:
        """Close the connection pool. The fleet can be used again afterwards (a new pool is made)."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None
        self._semaphore = None
        self._loop = None

    async def __aenter__(self) -> OpenAIReaderFleet:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
