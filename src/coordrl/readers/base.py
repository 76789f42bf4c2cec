"""The reader interface shared by every backend (lexical, OpenAI-compatible).

A reader is a frozen model bound to one chunk: asked a query, it answers from that chunk only or
says exactly ``UNKNOWN``. A fleet answers a batch of (query, chunk) pairs concurrently; the
environment never cares which backend served them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from coordrl.readers.prompt import reader_messages

UNKNOWN = "Unknown"


@dataclass(frozen=True)
class ReaderRequest:
    """One request to a model-served role. ``chunk_key`` routes it to a replica (cache-aware).

    A reader request (``messages`` None) asks ``query`` about ``chunk_text`` with the reader prompt.
    Any other role (index card writer, page selector, answer model) brings its own chat
    ``messages``, as ``(role, content)`` pairs, and leaves ``query`` and ``chunk_text`` empty; the
    backend sends exactly those.
    """

    query: str
    chunk_text: str
    chunk_key: str
    messages: tuple[tuple[str, str], ...] | None = None

    @classmethod
    def chat(cls, messages: Sequence[Mapping[str, str]], key: str) -> ReaderRequest:
        """A request that sends ``messages`` (``role`` and ``content`` of each) as given, routed by ``key``."""
        return cls("", "", key, tuple((m["role"], m["content"]) for m in messages))

    def chat_messages(self) -> list[dict[str, str]]:
        """The chat messages a model backend sends for this request: its own, or the reader prompt."""
        if self.messages is not None:
            return [{"role": role, "content": content} for role, content in self.messages]
        return reader_messages(self.chunk_text, self.query)


@dataclass(frozen=True)
class ReaderResult:
    """A reader's answer. ``ok`` is False when the backend failed after its retries; ``text`` is
    then empty and ``error`` says why. ``abstained`` is True for an exact ``Unknown``."""

    text: str
    ok: bool = True
    error: str | None = None
    latency_s: float = 0.0
    attempts: int = 1

    @property
    def abstained(self) -> bool:
        return self.ok and is_unknown(self.text)


def chunk_key(text: str) -> str:
    """A chunk's content key (16 hex characters of its SHA-1): the ``chunk_key`` of requests about it,
    so every request about one chunk goes to one replica, whose prefix cache holds it."""
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def is_unknown(text: str) -> bool:
    """True when a reader abstained: its answer, stripped of whitespace and final punctuation, is Unknown."""
    return text.strip().rstrip(".").strip().lower() == UNKNOWN.lower()


@runtime_checkable
class ReaderFleet(Protocol):
    """Answers many reader requests concurrently, in request order. Never raises for a backend
    failure: failures come back as ``ReaderResult(ok=False, ...)`` so an episode can go on."""

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]: ...

    async def aclose(self) -> None: ...
