"""What the reader measurements read: `CallMeter` on a reader fleet (calls, latencies, the wall time
some request was in flight) and the prefix-cache counters of a vLLM server's ``/metrics``.

The chat server is FaultInjectingFakeServer (loopback, latency and faults only); the metrics page is
text a real vLLM CPU server served.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import pytest
from fault_injecting_server import FaultInjectingFakeServer

from coordrl.readers.base import ReaderRequest
from coordrl.readers.meter import CallMeter
from coordrl.readers.openai_fleet import OpenAIReaderFleet
from coordrl.readers.serve import prefix_cache_counters

pytestmark = pytest.mark.timeout(60)


def _requests(n: int) -> list[ReaderRequest]:
    return [ReaderRequest(f"question {i}?", f"Document 1:\nT\nchunk text {i}.", f"c{i}") for i in range(n)]


def _fleet(url: str, **kw) -> OpenAIReaderFleet:
    return OpenAIReaderFleet([url], "reader-model", api_key_env=None, backoff_s=0.01, timeout_s=2.0, **kw)


async def _answer(fleet: OpenAIReaderFleet, requests: list[ReaderRequest]):
    try:
        return await fleet.answer(requests)
    finally:
        await fleet.aclose()


def test_busy_time_is_the_union_of_requests_in_flight_not_their_sum():
    with FaultInjectingFakeServer(latency_s=0.1) as server:
        fleet = _fleet(server.url, max_concurrency=4)
        fleet.meter = meter = CallMeter()
        t0 = time.perf_counter()
        first = asyncio.run(_answer(fleet, _requests(8)))  # two waves of four: ~0.2 s in flight
        wall = time.perf_counter() - t0
        time.sleep(0.3)  # nothing in flight: not reader time
        t0 = time.perf_counter()
        second = asyncio.run(_answer(fleet, _requests(4)))  # one wave: ~0.1 s
        wall += time.perf_counter() - t0
    results = first + second
    assert all(r.ok for r in results)
    assert meter.calls == 12 and meter.failures == 0
    # The latencies are the ones the results carry (queueing for a slot included), not a second timing.
    assert meter.latencies_s == pytest.approx([r.latency_s for r in first] + [r.latency_s for r in second])
    # Three waves of 0.1 s at least; the pause between the batches is not counted; overlapping
    # requests count once (the sum of latencies is about 1.6 s: four requests also queued a wave).
    assert 0.3 <= meter.busy_s <= wall
    assert meter.busy_s < 0.5 * sum(meter.latencies_s)
    summary = meter.summary()
    assert summary["calls"] == 12 and summary["busy_s"] == meter.busy_s
    assert 100 <= summary["latency_p50_ms"] <= summary["latency_p95_ms"] <= 1000 * max(meter.latencies_s)


def test_failures_and_cancelled_requests_end_their_call():
    with FaultInjectingFakeServer(hang_s=5.0) as server:
        fleet = _fleet(server.url, max_retries=0)
        fleet.meter = meter = CallMeter()
        server.fail_next("400")
        (failed,) = asyncio.run(_answer(fleet, _requests(1)))
        assert not failed.ok and meter.calls == 1 and meter.failures == 1

        server.fault_always = "hang"

        async def cancelled() -> None:
            task = asyncio.ensure_future(fleet.answer(_requests(3)))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await fleet.aclose()

        asyncio.run(cancelled())
    assert meter.calls == 4 and meter.failures == 4
    assert meter._in_flight == 0  # the next request starts a new busy period
    assert 0.2 <= meter.busy_s < 4.0  # cancelled after 0.2 s, long before the 5 s hang ends


def test_no_meter_by_default_and_an_empty_meter_reads_zero():
    assert _fleet("http://127.0.0.1:1").meter is None
    assert CallMeter().summary() == {
        "calls": 0,
        "failures": 0,
        "coalesced": 0,
        "busy_s": 0.0,
        "latency_p50_ms": 0.0,
        "latency_p95_ms": 0.0,
    }


# Lines of a real vLLM 0.32 CPU server's GET /metrics (serving the world reader, after a held-out
# evaluation), among them look-alikes that must not be counted: *_created gauges, the KV-connector's
# external_* counters and the per-tier cached-token counter.
VLLM_METRICS = """
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="MODEL"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="MODEL"} 25756.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="MODEL"} 1.796121055956656e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="MODEL"} 16000.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="MODEL"} 1.7961210559567058e+09
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="MODEL"} 0.0
# HELP vllm:external_prefix_cache_queries_created External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.
# TYPE vllm:external_prefix_cache_queries_created gauge
vllm:external_prefix_cache_queries_created{engine="0",model_name="MODEL"} 1.796121055956745e+09
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="MODEL"} 0.0
# HELP vllm:external_prefix_cache_hits_created External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.
# TYPE vllm:external_prefix_cache_hits_created gauge
vllm:external_prefix_cache_hits_created{engine="0",model_name="MODEL"} 1.7961210559567862e+09
# HELP vllm:prompt_tokens_cached_by_source_total Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="MODEL",source="device"} 16000.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="MODEL",source="host"} 0.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="MODEL",source="p2p"} 0.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="MODEL",source="disk"} 0.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="MODEL",source="external_unspecified"} 0.0
"""


@pytest.fixture()
def metrics_server():
    """A loopback server whose GET /metrics answers with ``served["text"]``."""
    served = {"text": ""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = served["text"].encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_prefix_cache_counters_read_a_real_vllm_metrics_page(metrics_server):
    served, url = metrics_server
    one = VLLM_METRICS.replace("MODEL", "/work/main/src/coordrl/resources/world_reader")
    served["text"] = one
    assert prefix_cache_counters(url) == (25756.0, 16000.0)
    # Two engines behind one server (data parallel): their counters add up.
    served["text"] = (
        one
        + "\n"
        + "\n".join(
            line.replace('engine="0"', 'engine="1"')
            for line in one.splitlines()
            if line.startswith("vllm:prefix_cache_")
        )
    )
    assert prefix_cache_counters(url + "/") == (2 * 25756.0, 2 * 16000.0)
