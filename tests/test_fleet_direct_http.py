"""OpenAIReaderFleet's direct path (chat POSTs on LeanAsyncTransport.post_bytes, no httpx.AsyncClient).

Every check runs the same requests through the direct path (the default for ``http://``) and through
``httpx.AsyncClient`` on the same transport (a caller-given ``LeanAsyncTransport`` keeps the httpx
path), and asserts identical bytes on the wire, answers, attempts and error messages.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket

import httpx
import pytest
from fault_injecting_server import FaultInjectingFakeServer
from test_http_transport import RawServer

from coordrl.readers.base import ReaderRequest, ReaderResult
from coordrl.readers.http_transport import LeanAsyncTransport
from coordrl.readers.openai_fleet import OpenAIReaderFleet, _Slots

pytestmark = pytest.mark.timeout(60)

SECRET = "sk-direct-SECRET-0123456789"
MODES = ("direct", "httpx")


def _req(i: int = 0) -> ReaderRequest:
    return ReaderRequest(query=f"question {i}?", chunk_text=f"Document 1:\nT\nchunk text {i} ü.", chunk_key=f"c{i}")


def _fleet(urls: list[str], mode: str, **kw) -> OpenAIReaderFleet:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("api_key_env", None)
    if mode == "httpx":
        kw["transport"] = LeanAsyncTransport()  # caller-given: goes through httpx.AsyncClient
    return OpenAIReaderFleet(urls, "reader-model", **kw)


async def _answer(fleet: OpenAIReaderFleet, requests: list[ReaderRequest]) -> list[ReaderResult]:
    try:
        return await fleet.answer(requests)
    finally:
        await fleet.aclose()


@pytest.fixture()
def calls(monkeypatch) -> dict[str, int]:
    """Counts of exchanges through httpx (handle_async_request) and through post_bytes."""
    counts = {"httpx": 0, "direct": 0}
    handle, post = LeanAsyncTransport.handle_async_request, LeanAsyncTransport.post_bytes

    async def counting_handle(self, request):
        counts["httpx"] += 1
        return await handle(self, request)

    async def counting_post(self, address, head, body, timeout_s=None):
        counts["direct"] += 1
        return await post(self, address, head, body, timeout_s)

    monkeypatch.setattr(LeanAsyncTransport, "handle_async_request", counting_handle)
    monkeypatch.setattr(LeanAsyncTransport, "post_bytes", counting_post)
    return counts


def _reply(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


def _chat(answer: str) -> bytes:
    return json.dumps({"choices": [{"message": {"content": answer}}]}).encode()


@pytest.mark.parametrize("api_key", [SECRET, None])
def test_direct_path_sends_the_bytes_httpx_would(monkeypatch, calls, api_key):
    if api_key:
        monkeypatch.setenv("COORDRL_TEST_DIRECT_KEY", api_key)
    else:
        monkeypatch.delenv("COORDRL_TEST_DIRECT_KEY", raising=False)

    async def run(mode: str) -> tuple[list[bytes], list[ReaderResult]]:
        async with RawServer([_reply(200, _chat(f"a{i}")) for i in range(3)]) as srv:
            fleet = _fleet([srv.url], mode, api_key_env="COORDRL_TEST_DIRECT_KEY")
            results = [(await fleet.answer([_req(i)]))[0] for i in range(3)]  # one at a time: replies in order
            await fleet.aclose()
            # The port differs between the two servers; everything else must match.
            return [r.replace(srv.url.rsplit(":", 1)[1].encode(), b"PORT") for r in srv.requests], results

    direct_requests, direct_results = asyncio.run(run("direct"))
    assert calls == {"httpx": 0, "direct": 3}
    httpx_requests, httpx_results = asyncio.run(run("httpx"))
    assert calls == {"httpx": 3, "direct": 3}
    assert direct_requests == httpx_requests
    assert [r.text for r in direct_results] == [r.text for r in httpx_results] == ["a0", "a1", "a2"]
    auth = f"\r\nAuthorization: Bearer {api_key}\r\n".encode()
    assert all((auth in r) == bool(api_key) for r in direct_requests)
    assert all(b"Host: 127.0.0.1:PORT\r\n" in r and b"Content-Type: application/json\r\n" in r for r in direct_requests)


@pytest.mark.parametrize("mode", MODES)
def test_api_key_reaches_the_server_and_is_never_shown(monkeypatch, calls, mode):
    monkeypatch.setenv("COORDRL_TEST_DIRECT_KEY", SECRET)
    with FaultInjectingFakeServer() as server:
        server.fail_next("503")
        fleet = _fleet([server.url], mode, api_key_env="COORDRL_TEST_DIRECT_KEY")
        (result,) = asyncio.run(_answer(fleet, [_req()]))
        assert result.ok and result.attempts == 2
        assert server.auth_headers == [f"Bearer {SECRET}"] * 2
    assert calls[mode] == 2 and calls["direct" if mode == "httpx" else "httpx"] == 0
    assert SECRET not in repr(fleet) + str(vars(fleet)) + repr(result)


@pytest.mark.parametrize(
    "faults",
    [("503",), ("500", "429"), ("drop",), ("500", "drop", "429"), ("400",), ("bad_json",), ("503", "400")],
)
def test_faults_are_handled_alike_on_both_paths(faults):
    outcomes = []
    for mode in MODES:
        with FaultInjectingFakeServer() as server:
            server.fail_next(*faults)
            (r,) = asyncio.run(_answer(_fleet([server.url], mode, max_retries=3), [_req()]))
            outcomes.append((r.ok, r.text, r.error, r.attempts, server.chat_requests))
    assert outcomes[0] == outcomes[1]
    ok, text, error, attempts, _ = outcomes[0]
    if "400" in faults or "bad_json" in faults:
        assert not ok and attempts == len(faults)
        assert error.startswith(("HTTP 400: ", "malformed reply: "))
    else:
        assert ok and text == "Answer: question 0?" and attempts == len(faults) + 1


@pytest.mark.parametrize("mode", MODES)
def test_timeout_cuts_a_hung_attempt_and_retries(mode):
    with FaultInjectingFakeServer(hang_s=5.0) as server:
        server.fail_next("hang")
        (r,) = asyncio.run(_answer(_fleet([server.url], mode, timeout_s=0.3, max_retries=2), [_req()]))
    assert r.ok and r.attempts == 2


@pytest.mark.parametrize("mode", MODES)
def test_gives_up_with_the_same_error(mode):
    with FaultInjectingFakeServer() as server:
        server.fault_always = "hang"
        server.hang_s = 5.0
        (r,) = asyncio.run(_answer(_fleet([server.url], mode, timeout_s=0.2, max_retries=1), [_req()]))
    assert not r.ok and r.attempts == 2 and r.error == "timeout after 0.2s"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (r,) = asyncio.run(_answer(_fleet([f"http://127.0.0.1:{port}"], mode, max_retries=1), [_req()]))
    assert not r.ok and r.attempts == 2 and r.error.startswith("ConnectError: 127.0.0.1:")


def test_encoded_and_non_utf8_replies_decode_alike():
    gz = gzip.compress(_chat("zipped ä"))
    replies = [
        _reply(200, gz, b"Content-Encoding: gzip\r\n"),
        _reply(400, "caf\xe9 refus\xe9".encode("latin-1"), b"Content-Type: text/plain; charset=latin-1\r\n"),
        _reply(502, b"\xff\xfe not utf-8"),
        _reply(200, b"[]"),
    ]

    async def run(mode: str) -> list[tuple]:
        async with RawServer(list(replies)) as srv:
            fleet = _fleet([srv.url], mode, max_retries=0)
            results = []
            for i in range(len(replies)):
                (r,) = await fleet.answer([_req(i)])
                results.append((r.ok, r.text, r.error))
            await fleet.aclose()
            return results

    direct, via_httpx = asyncio.run(run("direct")), asyncio.run(run("httpx"))
    assert direct == via_httpx
    assert direct[0] == (True, "zipped ä", None)
    assert direct[1][2] == "HTTP 400: café refusé"
    assert direct[2][2].startswith("HTTP 502: \ufffd")
    assert direct[3][2] == "malformed reply: []"


def test_caller_transport_goes_through_httpx_client():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"message": {"content": "mocked"}}]})

    fleet = OpenAIReaderFleet(
        ["http://reader.invalid:8000"], "m", api_key_env=None, transport=httpx.MockTransport(handler)
    )
    results = asyncio.run(_answer(fleet, [_req(0), _req(1)]))
    assert [r.text for r in results] == ["mocked", "mocked"]
    assert [str(r.url) for r in seen] == ["http://reader.invalid:8000/v1/chat/completions"] * 2
    assert all(r.headers["content-type"] == "application/json" for r in seen)


def test_https_replicas_go_through_httpx(monkeypatch, calls):
    """A mixed fleet: the http replica is served directly, the https one through httpx's client."""
    https_seen: list[str] = []

    async def fake_fallback(self, request):  # stands in for httpx's own transport (no TLS server here)
        https_seen.append(str(request.url))
        return httpx.Response(200, json={"choices": [{"message": {"content": "via https"}}]}, request=request)

    with FaultInjectingFakeServer() as server:
        urls = [server.url, "https://reader.invalid"]
        fleet = _fleet(urls, "direct")
        keys = [f"k{i}" for i in range(40)]
        requests = [ReaderRequest("q?", "text", k) for k in keys]
        original = LeanAsyncTransport.handle_async_request

        async def route(self, request):
            if request.url.scheme == "https":
                return await fake_fallback(self, request)
            return await original(self, request)

        monkeypatch.setattr(LeanAsyncTransport, "handle_async_request", route)
        results = asyncio.run(_answer(fleet, requests))
    to_https = [fleet.route(k) == urls[1] for k in keys]
    assert 0 < sum(to_https) < len(keys)
    assert [r.text for r in results] == ["via https" if h else "Answer: q?" for h in to_https]
    assert len(https_seen) == sum(to_https) and server.chat_requests == len(keys) - sum(to_https)
    assert calls["direct"] == server.chat_requests


def test_slots_bound_concurrency_and_survive_cancellation():
    async def go():
        slots = _Slots(2)
        running = peak = 0

        async def work(delay: float) -> None:
            nonlocal running, peak
            async with slots:
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(delay)
                running -= 1

        tasks = [asyncio.create_task(work(0.01)) for _ in range(10)]
        await asyncio.sleep(0)
        tasks[5].cancel()  # cancelled while queued
        await asyncio.gather(*tasks, return_exceptions=True)
        assert peak == 2 and slots._free == 2 and not slots._waiters

        # A waiter handed a slot but cancelled before it resumes passes the slot on.
        async with slots:
            async with slots:
                waiter = asyncio.create_task(work(0))
                other = asyncio.create_task(work(0))
                await asyncio.sleep(0)
            waiter.cancel()  # the inner release just handed its slot to `waiter`
        await asyncio.gather(waiter, other, return_exceptions=True)
        assert waiter.cancelled() and other.done() and not other.cancelled()
        assert slots._free == 2 and not slots._waiters

    asyncio.run(go())


def test_batch_tail_cache_keeps_bodies_byte_identical():
    """Within a batch the encoded question + sampling fields are reused per query string."""
    import random

    rng = random.Random(1)
    for extra in ({}, {"top_p": 0.5}, {"model": "other"}):
        fleet = OpenAIReaderFleet(["http://127.0.0.1:9"], "m", api_key_env=None, extra_body=extra)
        tails: dict[str, bytes] = {}
        queries = [" Who?", "Quand é?\n", "<think>x</think>", ""]
        for i in range(100):
            request = ReaderRequest(rng.choice(queries), "".join(rng.choice('ab\n"ü<') for _ in range(50)), f"k{i}")
            assert fleet._encode_body(request, tails) == fleet.encode_body(request)
            assert fleet.encode_body(request) == json.dumps(fleet.request_body(request), separators=(",", ":")).encode()
        fleet.max_tokens = 7  # a change between batches applies to the next batch
        body = json.loads(fleet._encode_body(ReaderRequest("Who?", "t", "k"), {}))
        assert body["max_tokens"] == 7


def test_json_string_fast_path_is_byte_identical_to_json_dumps():
    import random

    from coordrl.readers.openai_fleet import _json_string

    rng = random.Random(2)
    alphabet = [chr(c) for c in range(128)] + ["é", "😀", "\u2028", "\ufeff"]
    plain = 'the quick brown fox\n\t"quoted" back\\slash\r\n'
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert _json_string(text) == json.dumps(text).encode(), text
        long = plain * rng.randint(1, 50) + text  # the fast path, then the fallback at the end
        assert _json_string(long) == json.dumps(long).encode()


def test_non_ascii_api_key_fails_alike(monkeypatch):
    monkeypatch.setenv("COORDRL_TEST_DIRECT_KEY", "cl\u00e9")
    errors = []
    for mode in MODES:
        with FaultInjectingFakeServer() as server:
            fleet = _fleet([server.url], mode, api_key_env="COORDRL_TEST_DIRECT_KEY")
            (r,) = asyncio.run(_answer(fleet, [_req()]))
            assert not r.ok and r.attempts == 1 and server.chat_requests == 0
            errors.append(r.error)
    assert errors[0] == errors[1] and errors[0].startswith("unexpected UnicodeEncodeError")


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.1])
def test_cancelled_batch_leaves_no_request_running(cancel_after_s):
    """Cancelled while its tasks are still being created (0 s) or while they wait on the server."""
    with FaultInjectingFakeServer(latency_s=1.0) as server:

        async def go():
            fleet = _fleet([server.url], "direct", max_concurrency=8)
            batch = asyncio.create_task(fleet.answer([_req(i) for i in range(100)]))
            await asyncio.sleep(cancel_after_s)
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
            await asyncio.sleep(0.05)
            assert asyncio.all_tasks() == {asyncio.current_task()}
            assert fleet._semaphore is not None and fleet._semaphore._free == 8
            await fleet.aclose()

        asyncio.run(go())
