"""The reader interface shared by every backend (lexical, OpenAI-compatible).

A reader is a frozen model bound to one chunk: asked a query, it answers from that chunk only or
says exactly ``UNKNOWN``. A fleet answers a batch of (query, chunk) pairs concurrently; the
environment never cares which backend served them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

UNKNOWN = "Unknown"


@dataclass(frozen=True)
class ReaderRequest:
    """One query to one chunk. ``chunk_key`` identifies the chunk for cache-aware routing."""

    query: str
    chunk_text: str
    chunk_key: str


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


def is_unknown(text: str) -> bool:
    """True when a reader abstained: its answer, stripped of whitespace and final punctuation, is Unknown."""
    return text.strip().rstrip(".").strip().lower() == UNKNOWN.lower()


@runtime_checkable
class ReaderFleet(Protocol):
    """Answers many reader requests concurrently, in request order. Never raises for a backend
    failure: failures come back as ``ReaderResult(ok=False, ...)`` so an episode can go on."""

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]: ...

    async def aclose(self) -> None: ...
