"""One retry policy for every model client: attempts, exponential backoff, which failures retry.

An attempt reports a failure that another attempt may fix by raising :class:`Retryable`, and one
that no attempt can fix by raising :class:`Fatal`; each carries the error message to report. Any
other exception is the caller's business and propagates at once, untouched. The policy runs
attempts in its sync form (:meth:`RetryPolicy.run`, for ``httpx.Client`` callers) or async form
(:meth:`RetryPolicy.arun`, which sleeps with ``asyncio.sleep``, so a request waiting to retry holds
nothing but its task), and returns an :class:`Outcome` that says how many attempts were made.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["DEFAULT_RETRIES", "DEFAULT_TIMEOUT_S", "Fatal", "Outcome", "RetryPolicy", "Retryable"]

# The request limits a model client starts from: every frozen role's settings (PARSER readers, HMARS
# backends, the dense router) default to these, so the roles fail over alike unless configured apart.
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_RETRIES = 3

T = TypeVar("T")


class Retryable(Exception):
    """An attempt failed in a way that another attempt may fix (timeout, refused, reset, 5xx, 429)."""


class Fatal(Exception):
    """An attempt failed in a way that retrying cannot fix (other 4xx, a malformed reply)."""


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What a run of attempts came to: ``value`` on success, else ``error`` (the last failure's message).

    ``gave_up`` is True when every attempt failed with :class:`Retryable` (the budget ran out),
    False on success or when a :class:`Fatal` failure ended the run early.
    """

    value: T | None
    attempts: int
    error: str | None = None
    gave_up: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` further attempts after the first; ``backoff_s`` before the first retry, doubled each time.

    A run of attempts that all time out after ``timeout_s`` therefore costs at most
    :meth:`worst_case_s` of wall time.
    """

    retries: int
    backoff_s: float

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")

    @property
    def attempts(self) -> int:
        """The most attempts a run makes."""
        return self.retries + 1

    def delay_s(self, attempt: int) -> float:
        """Sleep before attempt number ``attempt`` (0 for the first): 0, backoff, 2 x backoff, 4 x ..."""
        return self.backoff_s * 2 ** (attempt - 1) if attempt else 0.0

    def worst_case_s(self, timeout_s: float) -> float:
        """Wall time of a run whose every attempt hits ``timeout_s``."""
        return timeout_s * self.attempts + self.backoff_s * (2**self.retries - 1)

    def run(self, attempt: Callable[[], T]) -> Outcome[T]:
        """Call ``attempt()`` until it returns, raises :class:`Fatal`, or the retries run out."""
        error = "no attempt made"
        for n in range(self.attempts):
            if n:
                time.sleep(self.delay_s(n))
            try:
                return Outcome(attempt(), n + 1)
            except Retryable as exc:
                error = str(exc)
            except Fatal as exc:
                return Outcome(None, n + 1, str(exc))
        return Outcome(None, self.attempts, error, gave_up=True)

    async def arun(self, attempt: Callable[[], Awaitable[T]]) -> Outcome[T]:
        """:meth:`run` for a coroutine function; backoff sleeps do not block the event loop."""
        error = "no attempt made"
        for n in range(self.attempts):
            if n:
                await asyncio.sleep(self.delay_s(n))
            try:
                return Outcome(await attempt(), n + 1)
            except Retryable as exc:
                error = str(exc)
            except Fatal as exc:
                return Outcome(None, n + 1, str(exc))
        return Outcome(None, self.attempts, error, gave_up=True)
