"""OpenAIReaderFleet under injected faults: retries, giving up, routing, concurrency, API-key hygiene.

The server is FaultInjectingFakeServer (loopback, fault injection only); real-server behaviour is
in test_vllm_cpu_integration.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
from fault_injecting_server import FaultInjectingFakeServer

from coordrl.readers.base import ReaderFleet, ReaderRequest
from coordrl.readers.openai_fleet import OpenAIReaderFleet, health, replica_index

pytestmark = pytest.mark.timeout(60)

SECRET = "sk-test-SECRET-value-0123456789"


def _req(i: int = 0, key: str | None = None) -> ReaderRequest:
    return ReaderRequest(
        query=f"question {i}?", chunk_text=f"Document 1:\nT\nchunk text {i}.", chunk_key=key or f"c{i}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def server():
    with FaultInjectingFakeServer() as srv:
        yield srv


def _fleet(urls, **kw) -> OpenAIReaderFleet:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("api_key_env", None)
    return OpenAIReaderFleet(urls, "reader-model", **kw)


async def _answer(fleet: OpenAIReaderFleet, requests):
    try:
        return await fleet.answer(requests)
    finally:
        await fleet.aclose()


def test_is_a_reader_fleet_and_answers_in_order(server):
    fleet = _fleet([server.url])
    assert isinstance(fleet, ReaderFleet)
    results = asyncio.run(_answer(fleet, [_req(i) for i in range(20)]))
    assert [r.text for r in results] == [f"Answer: question {i}?" for i in range(20)]
    assert all(r.ok and r.attempts == 1 and r.latency_s > 0 for r in results)
    assert server.models_seen == ["reader-model"] * 20
    assert asyncio.run(_answer(fleet, [])) == []


@pytest.mark.parametrize("faults", [("500",), ("503", "429"), ("drop",), ("500", "drop", "429")])
def test_retries_transient_faults_then_succeeds(server, faults):
    server.fail_next(*faults)
    (result,) = asyncio.run(_answer(_fleet([server.url], max_retries=3), [_req()]))
    assert result.ok and result.text == "Answer: question 0?"
    assert result.attempts == len(faults) + 1


def test_retries_after_timeout(server):
    server.hang_s = 5.0
    server.fail_next("hang")
    t0 = time.perf_counter()
    (result,) = asyncio.run(_answer(_fleet([server.url], timeout_s=0.3, max_retries=2), [_req()]))
    assert result.ok and result.attempts == 2
    assert time.perf_counter() - t0 < 3.0  # the hung attempt was cut at timeout_s, not hang_s


def test_retries_connection_refused_until_server_comes_up():
    port = _free_port()
    srv = FaultInjectingFakeServer(port=port)
    starter = threading.Timer(0.4, srv.start)
    starter.start()
    try:
        fleet = _fleet([f"http://127.0.0.1:{port}"], backoff_s=0.1, max_retries=5)
        (result,) = asyncio.run(_answer(fleet, [_req()]))
        assert result.ok, result.error
        assert result.attempts >= 2  # 0.1 + 0.2 s of backoff before the server can answer
    finally:
        starter.join()
        srv.stop()


def test_gives_up_after_retry_budget_without_raising(server):
    server.fault_always = "500"
    results = asyncio.run(_answer(_fleet([server.url], max_retries=2), [_req(0), _req(1)]))
    for r in results:
        assert not r.ok and r.text == "" and r.attempts == 3
        assert "HTTP 500" in r.error
        assert not r.abstained
    assert server.chat_requests == 6


def test_gives_up_on_refused_connection_without_raising():
    url = f"http://127.0.0.1:{_free_port()}"
    (result,) = asyncio.run(_answer(_fleet([url], max_retries=2), [_req()]))
    assert not result.ok and result.attempts == 3 and "Connect" in result.error


@pytest.mark.parametrize("fault", ["400", "bad_json"])
def test_client_errors_are_not_retried(server, fault):
    server.fail_next(fault)
    (result,) = asyncio.run(_answer(_fleet([server.url], max_retries=3), [_req()]))
    assert not result.ok and result.attempts == 1
    assert server.chat_requests == 1


def test_routing_is_stable_across_instances_and_processes():
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    a, b = _fleet(urls), _fleet(list(urls))
    keys = [f"doc7/chunk{i}" for i in range(200)]
    assert [a.route(k) for k in keys] == [b.route(k) for k in keys]
    # Pinned values: sha1-based, so they can never drift with PYTHONHASHSEED or the Python version.
    assert [replica_index(k, 4) for k in ("a", "b", "doc7/chunk0")] == [
        int.from_bytes(__import__("hashlib").sha1(k.encode()).digest()[:8], "big") % 4
        for k in ("a", "b", "doc7/chunk0")
    ]
    assert len({a.route(k) for k in keys}) == 4  # every replica gets work


def test_requests_go_to_the_routed_replica():
    with FaultInjectingFakeServer() as s1, FaultInjectingFakeServer() as s2:
        fleet = _fleet([s1.url, s2.url])
        requests = [_req(i, key=f"chunk-{i % 10}") for i in range(60)]
        asyncio.run(_answer(fleet, requests))
        expected_s1 = sum(1 for r in requests if fleet.route(r.chunk_key) == s1.url)
        assert s1.chat_requests == expected_s1
        assert s2.chat_requests == 60 - expected_s1
        assert 0 < expected_s1 < 60


def test_concurrency_bound_is_respected(server):
    server.latency_s = 0.05
    fleet = _fleet([server.url], max_concurrency=4)
    results = asyncio.run(_answer(fleet, [_req(i) for i in range(40)]))
    assert all(r.ok for r in results)
    assert server.max_in_flight == 4


def test_api_key_sent_as_bearer_but_never_shown(server, monkeypatch, caplog):
    monkeypatch.setenv("COORDRL_TEST_READER_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    fleet = _fleet([server.url], api_key_env="COORDRL_TEST_READER_KEY", max_retries=1)
    results = asyncio.run(_answer(fleet, [_req(0)]))
    server.fault_always = "500"
    results += asyncio.run(_answer(fleet, [_req(1)]))
    assert server.auth_headers == [f"Bearer {SECRET}"] * 3
    assert results[0].ok and not results[1].ok  # the second exhausted its retries and was logged
    assert caplog.records, "the failure should have been logged"
    shown = [repr(fleet), str(fleet), caplog.text] + [repr(r) for r in results]
    shown += [str(vars(fleet))]
    for text in shown:
        assert SECRET not in text


def test_no_authorization_header_without_key(server, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    asyncio.run(_answer(OpenAIReaderFleet([server.url], "m"), [_req()]))
    assert server.auth_headers == [None]


def test_answers_are_sanitised(server):
    server.responder = lambda body: '<tool_call>{"name": "answer", "arguments": {"answer": "x"}}</tool_call><|im_end|>'
    (result,) = asyncio.run(_answer(_fleet([server.url]), [_req()]))
    assert result.ok
    assert "<tool_call>" not in result.text and "</tool_call>" not in result.text and "<|im_end|>" not in result.text
    assert "\u2039tool_call\u203a" in result.text


def test_leading_think_block_is_dropped(server):
    server.responder = lambda body: "<think>\nhmm\n</think>\n\nUnknown"
    (result,) = asyncio.run(_answer(_fleet([server.url]), [_req()]))
    assert result.text == "Unknown" and result.abstained


def test_fleet_survives_a_new_event_loop_per_batch(server):
    fleet = _fleet([server.url])
    for _ in range(3):  # e.g. a trainer calling asyncio.run() once per step
        (result,) = asyncio.run(fleet.answer([_req()]))
        assert result.ok


def test_health_helper(server):
    assert asyncio.run(health(server.url))
    assert asyncio.run(health(server.url + "/v1/"))
    assert not asyncio.run(health(f"http://127.0.0.1:{_free_port()}", timeout_s=1.0))


def test_cached_body_encoding_is_byte_identical_to_json_dumps():
    """The fast path reuses the escaped passage per chunk; the bytes must equal a plain json.dumps,
    also when a caller reuses a chunk_key for different text or overrides fields."""
    import json
    import random

    rng = random.Random(0)
    pieces = ["a", "ü", "😀", "\n", '"', "\\", "<tool_call>", "Document 1:\n", " "]
    for extra in ({}, {"top_p": 0.9, "temperature": 0.3}, {"model": "other"}):
        fleet = OpenAIReaderFleet(["http://127.0.0.1:9"], 'm"ü', api_key_env=None, extra_body=extra)
        for i in range(200):
            chunk = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 200)))
            query = "".join(rng.choice(["b", "é", "\t", "?", " ", "</tool_call>"]) for _ in range(rng.randint(0, 30)))
            request = ReaderRequest(query, chunk, f"k{i % 5}")
            assert fleet.encode_body(request) == json.dumps(fleet.request_body(request), separators=(",", ":")).encode()


def test_fake_server_answers_pipelined_requests_in_order():
    """The fault server is a Protocol that delays replies with timers; two requests written back to
    back on one connection (the first one delayed) must still come back in request order."""
    import json

    def chat(question: str) -> bytes:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"Question: {question}"}]}).encode()
        return b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    with (
        FaultInjectingFakeServer(latency_s=0.05) as server,
        socket.create_connection((server.host, server.port), timeout=5) as sock,
    ):
        sock.sendall(chat("first") + chat("second"))
        data = b""
        while data.count(b"Answer: ") < 2:
            chunk = sock.recv(65536)
            assert chunk, "server closed the connection"
            data += chunk
    assert data.index(b"Answer: first") < data.index(b"Answer: second")
    assert server.chat_requests == 2 and server.in_flight == 0
