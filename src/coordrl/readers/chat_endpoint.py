"""Model endpoints that take whole conversations: the HMARS card writer, page selector and answer model.

A `ChatEndpoint` sends each conversation's messages exactly as given (no reader prompt, no
sanitising of the reply: callers parse the reply first, a selector's JSON or the answer model's
``<answer>`` tag, and neutralise what they pass on). It shares the HTTP side with the reader fleet
(:class:`~coordrl.readers.chat_client.ChatCompletionsClient`: pooling, deadlines, retries,
replica routing, never-raise failures) but is not a reader fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from coordrl.data.errors import DataError
from coordrl.readers.base import ReaderResult
from coordrl.readers.chat_client import DEFAULT_API_KEY_ENV, ChatCompletionsClient

__all__ = ["ChatEndpoint", "make_chat_endpoint"]

logger = logging.getLogger(__name__)


class ChatEndpoint(ChatCompletionsClient):
    """One completion per conversation from OpenAI-compatible servers (arguments: see `ChatCompletionsClient`)."""

    def request_body(self, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        """The JSON body sent for ``messages``."""
        return self.chat_body(messages)

    def encode_body(self, messages: Sequence[Mapping[str, str]]) -> bytes:
        """The bytes sent for ``messages``: compact ``json.dumps`` of :meth:`request_body`."""
        return json.dumps(self.request_body(messages), separators=(",", ":")).encode()

    async def chat(
        self, conversations: Sequence[Sequence[Mapping[str, str]]], keys: Sequence[str] | None = None
    ) -> list[ReaderResult]:
        """One completion per conversation, concurrently (at most ``max_concurrency`` in flight), in order.

        ``keys`` route to replicas (default: the conversation's index). A failed conversation comes
        back with ``ok=False`` and its error; none raises.
        """
        keys = list(keys) if keys is not None else [str(i) for i in range(len(conversations))]
        if len(keys) != len(conversations):
            raise ValueError(f"{len(conversations)} conversations but {len(keys)} keys")
        results = await asyncio.gather(*(self.complete(k, self.encode_body(c)) for c, k in zip(conversations, keys)))
        failed = [r for r in results if not r.ok]
        if failed:
            # One line per batch: an outage must not print a warning per request.
            logger.warning("%d of %d chat requests failed; first error: %s", len(failed), len(results), failed[0].error)
        return list(results)


def make_chat_endpoint(
    spec: str, model: str | None, api_key_env: str | None = DEFAULT_API_KEY_ENV, **options: Any
) -> ChatEndpoint | None:
    """None for ``lexical``; else a `ChatEndpoint` over the comma-separated URLs in ``spec``.

    ``options`` go to `ChatEndpoint` (``max_tokens``, ``timeout_s``, ``max_retries``,
    ``max_concurrency``, ``backoff_s``, ``extra_body``).
    """
    spec = (spec or "lexical").strip()
    if spec == "lexical":
        return None
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise DataError(f"a backend must be 'lexical' or comma-separated http(s) URLs, got {spec!r}")
    if not model:
        raise DataError(f"backend {spec!r} needs the served model name")
    return ChatEndpoint(urls, model, api_key_env=api_key_env, **options)
