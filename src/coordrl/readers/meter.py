"""What a model-served client's requests cost over a phase: calls, their latencies, and the wall time
during which at least one of them was in flight.

Opt-in: ``client.meter = CallMeter()`` on a :class:`~coordrl.readers.chat_client.ChatCompletionsClient`
(the reader fleet). Why here: an episode reports its own reader calls and latency percentiles, but
episodes of one tool round wait on their readers at the same time, so no sum over episodes says how
long a training step waited on readers; only the client sees every request begin and end. The
latency recorded is the one the client already measures for ``ReaderResult.latency_s`` (request
issued to reply, queueing for a concurrency slot and retries included).

Updated from the event loop that runs the requests (one thread), so it takes no lock; read it when
the phase is over. It keeps every latency, so it is for bounded phases (a benchmark), not left on
for a long run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from coordrl.rewards.metrics import nearest_rank_percentile

__all__ = ["CallMeter"]


@dataclass
class CallMeter:
    """Requests begun and ended through a client, and how long some request was in flight."""

    calls: int = 0
    failures: int = 0
    coalesced: int = 0
    latencies_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0
    _in_flight: int = 0
    _busy_since: float = 0.0

    def begin(self) -> None:
        """A request starts; a busy period starts with the first request in flight."""
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1

    def end(self, latency_s: float, ok: bool = True, coalesced: bool = False) -> None:
        """A request ended (answered, failed after its retries, or cancelled: ``ok`` False); ``coalesced``:
        it was answered by an identical request already in flight, not sent itself."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self.busy_s += time.perf_counter() - self._busy_since
        self.calls += 1
        self.failures += not ok
        self.coalesced += coalesced
        self.latencies_s.append(latency_s)

    def summary(self) -> dict[str, float | int]:
        """``calls``, ``failures``, ``coalesced`` (calls answered by an identical request in flight; the server
        received ``calls - coalesced``), ``busy_s`` and the nearest-rank latency percentiles in ms (0 without
        calls)."""
        lat = self.latencies_s
        return {
            "calls": self.calls,
            "failures": self.failures,
            "coalesced": self.coalesced,
            "busy_s": self.busy_s,
            "latency_p50_ms": 1000 * nearest_rank_percentile(lat, 50) if lat else 0.0,
            "latency_p95_ms": 1000 * nearest_rank_percentile(lat, 95) if lat else 0.0,
        }
