"""Identical requests in flight at once are sent once (`ChatCompletionsClient.coalesce`).

The server is FaultInjectingFakeServer (loopback HTTP; latency and hangs injected so that requests
overlap): what it counts is what was sent.
"""

from __future__ import annotations

import asyncio

import pytest
from fault_injecting_server import FaultInjectingFakeServer

from coordrl.readers.base import ReaderRequest
from coordrl.readers.meter import CallMeter
from coordrl.readers.openai_fleet import OpenAIReaderFleet

pytestmark = pytest.mark.timeout(60)


def _fleet(url: str, **kw) -> OpenAIReaderFleet:
    return OpenAIReaderFleet([url], "reader-model", api_key_env=None, backoff_s=0.01, timeout_s=5.0, **kw)


def _group() -> list[ReaderRequest]:
    """A GRPO group's round: six rollouts ask the same query of one chunk, two ask their own."""
    same = [
        ReaderRequest("Who directed the film Nuvol?", "Document 1:\nNuvol\nThe film Nuvol.", "c0") for _ in range(6)
    ]
    own = [
        ReaderRequest(f"Who directed the film Kef{i}?", "Document 1:\nNuvol\nThe film Nuvol.", "c0") for i in range(2)
    ]
    return same + own


async def _rollouts(fleet: OpenAIReaderFleet, requests: list[ReaderRequest]):
    """Each request from its own rollout, concurrently, as the trainer's tool rounds run them."""
    try:
        return [r for rs in await asyncio.gather(*(fleet.answer([q]) for q in requests)) for r in rs]
    finally:
        await fleet.aclose()


@pytest.mark.parametrize(
    ("settings", "sent"),
    [({}, 3), ({"coalesce": False}, 8), ({"temperature": 0.7}, 8), ({"extra_body": {"temperature": 0.7}}, 8)],
)
def test_identical_greedy_requests_in_flight_are_sent_once(settings, sent):
    with FaultInjectingFakeServer(latency_s=0.2) as server:
        fleet = _fleet(server.url, **settings)
        fleet.meter = meter = CallMeter()
        results = asyncio.run(_rollouts(fleet, _group()))
        assert server.chat_requests == sent
        # Every caller gets the reply its own request would get, and its own latency.
        assert [r.text for r in results] == ["Answer: Who directed the film Nuvol?"] * 6 + [
            f"Answer: Who directed the film Kef{i}?" for i in range(2)
        ]
        assert all(r.ok and r.latency_s >= 0.2 for r in results)
        assert (meter.calls, meter.coalesced) == (8, 8 - sent)
        assert meter.summary()["coalesced"] == 8 - sent
        assert not fleet._flights
        # Not a cache: the same requests once the first ones are answered are sent again.
        server.reset_counters()
        asyncio.run(_rollouts(fleet, _group()))
        assert server.chat_requests == sent


def test_a_failed_request_fails_every_caller_that_joined_it():
    with FaultInjectingFakeServer(latency_s=0.1) as server:
        server.fault_always = "400"
        results = asyncio.run(_rollouts(_fleet(server.url, max_retries=0), _group()[:6]))
        assert server.chat_requests == 1
        assert all(not r.ok and "HTTP 400" in r.error for r in results)


def test_cancelled_callers_leave_no_request_behind():
    with FaultInjectingFakeServer(hang_s=5.0) as server:
        server.fault_always = "hang"
        fleet = _fleet(server.url, max_retries=0)
        request = _group()[0]

        async def run() -> None:
            first = asyncio.ensure_future(fleet.answer([request]))
            second = asyncio.ensure_future(fleet.answer([request]))
            await asyncio.sleep(0.2)
            assert server.chat_requests == 1 and len(fleet._flights) == 1
            first.cancel()  # the other caller still waits: the request goes on
            await asyncio.sleep(0.1)
            (flight,) = fleet._flights.values()
            assert not flight.task.done() and flight.waiters == 1
            second.cancel()  # the last caller: the request is cancelled and forgotten
            await asyncio.sleep(0.1)
            assert flight.task.cancelled() and not fleet._flights
            for task in (first, second):
                with pytest.raises(asyncio.CancelledError):
                    await task
            await fleet.aclose()

        asyncio.run(run())
