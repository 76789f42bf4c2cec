"""A reader fleet served by OpenAI-compatible chat servers (vLLM replicas, or a hosted API).

The HTTP side (one pooled aiohttp session, the concurrency bound, per-attempt deadlines, retries,
replica routing) is :class:`~coordrl.readers.chat_client.ChatCompletionsClient`; what this module
adds is the reader's request and reply. Each chunk is pinned to one replica by a stable hash of its
``chunk_key``, so every query to a chunk lands where that chunk's prefix is already cached, and a
broadcast's bodies are encoded with the sanitised, JSON-escaped passage cached per chunk.

Failures never raise: after the retry budget a request comes back as
``ReaderResult(ok=False, error=...)`` so that an episode can go on without that reader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

from coordrl.readers.base import ReaderRequest, ReaderResult
from coordrl.readers.chat_client import ChatCompletionsClient, health, normalize_base_url, replica_index
from coordrl.readers.prompt import (
    READER_CHAT_TEMPLATE_KWARGS,
    reader_messages,
    sanitize_reader_text,
)

__all__ = ["OpenAIReaderFleet", "health", "normalize_base_url", "replica_index"]

logger = logging.getLogger(__name__)

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


class OpenAIReaderFleet(ChatCompletionsClient):
    """:class:`~coordrl.readers.base.ReaderFleet` over OpenAI-compatible ``/v1/chat/completions``.

    Takes :class:`~coordrl.readers.chat_client.ChatCompletionsClient`'s arguments (``urls``,
    ``model``, ``api_key_env``, ``max_concurrency``, ``timeout_s``, ``max_retries``, ``backoff_s``,
    ``max_tokens``, ``temperature``, ``extra_body``); each request is routed by its ``chunk_key``.
    """

    @functools.cached_property
    def _heads(self) -> dict[tuple[str, str], bytes]:
        """(chunk_key, text) -> encoded body up to the question; insertion-ordered, oldest dropped first."""
        return {}

    def request_body(self, request: ReaderRequest) -> dict[str, Any]:
        """The JSON body sent for ``request``: the one place where a request's body is defined.

        Messages come from :meth:`ReaderRequest.chat_messages` (the reader prompt of
        :func:`reader_messages`, or the request's own messages for every other role). A subclass may
        override this; :meth:`encode_body` then sends exactly what the override returns.
        """
        return self.chat_body(request.chat_messages())

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

    async def _answer_one(self, request: ReaderRequest, tails: dict[str, bytes]) -> ReaderResult:
        payload = self._encode_body(request, tails)  # once for all attempts
        result = await self.complete(request.chunk_key, payload)
        if not result.ok:
            logger.debug(
                "reader request to %s failed after %d attempt(s): %s",
                self.route(request.chunk_key),
                result.attempts,
                result.error,
            )
        elif request.messages is None:
            # A reader's answer goes to the policy as a finding: neutralised here. Other roles'
            # replies are parsed first (a selector's JSON, the answer model's <answer> tag) and
            # their callers neutralise what they pass on.
            return dataclasses.replace(result, text=sanitize_reader_text(result.text))
        return result

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
