"""OpenAIReaderFleet on the wire: request bytes, reply decoding, faults, deadlines, API-key hygiene,
the concurrency slots, cancellation and the cached body encoding.

Servers are loopback ones: FaultInjectingFakeServer for faults and latency, and RawServer (below)
where a check needs the exact request bytes or a hand-made reply.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket

import pytest
from fault_injecting_server import FaultInjectingFakeServer

from coordrl.readers.base import ReaderRequest, ReaderResult
from coordrl.readers.chat_client import _Slots
from coordrl.readers.openai_fleet import OpenAIReaderFleet

pytestmark = pytest.mark.timeout(60)

SECRET = "sk-direct-SECRET-0123456789"


def _req(i: int = 0) -> ReaderRequest:
    return ReaderRequest(query=f"question {i}?", chunk_text=f"Document 1:\nT\nchunk text {i} ü.", chunk_key=f"c{i}")


def _fleet(urls: list[str], **kw) -> OpenAIReaderFleet:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("api_key_env", None)
    return OpenAIReaderFleet(urls, "reader-model", **kw)


async def _answer(fleet: OpenAIReaderFleet, requests: list[ReaderRequest]) -> list[ReaderResult]:
    try:
        return await fleet.answer(requests)
    finally:
        await fleet.aclose()


class RawServer:
    """Loopback server replying with canned raw bytes; records every request's bytes."""

    def __init__(self, replies: list[bytes]):
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                writer.write(self.replies.pop(0))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def _reply(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


def _chat(answer: str) -> bytes:
    return json.dumps({"choices": [{"message": {"content": answer}}]}).encode()


@pytest.mark.parametrize("api_key", [SECRET, None])
def test_request_bytes_are_the_encoded_body_with_the_right_headers(monkeypatch, api_key):
    if api_key:
        monkeypatch.setenv("COORDRL_TEST_DIRECT_KEY", api_key)
    else:
        monkeypatch.delenv("COORDRL_TEST_DIRECT_KEY", raising=False)

    async def run() -> tuple[list[bytes], list[ReaderResult], int, OpenAIReaderFleet, str]:
        async with RawServer([_reply(200, _chat(f"a{i}")) for i in range(3)]) as srv:
            fleet = _fleet([srv.url], api_key_env="COORDRL_TEST_DIRECT_KEY")
            results = [(await fleet.answer([_req(i)]))[0] for i in range(3)]  # one at a time: replies in order
            await fleet.aclose()
            return srv.requests, results, srv.connections, fleet, srv.url.rsplit(":", 1)[1]

    requests, results, connections, fleet, port = asyncio.run(run())
    assert [r.text for r in results] == ["a0", "a1", "a2"]
    assert connections == 1  # kept alive between requests
    auth = f"\r\nAuthorization: Bearer {api_key}\r\n".encode()
    for i, raw in enumerate(requests):
        head, body = raw.split(b"\r\n\r\n", 1)
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert b"\r\nHost: 127.0.0.1:%s\r\n" % port.encode() in head + b"\r\n"
        assert b"\r\nContent-Type: application/json\r\n" in head + b"\r\n"
        assert b"\r\nContent-Length: %d\r\n" % len(body) in head + b"\r\n"
        assert (auth in head + b"\r\n") == bool(api_key)
        assert body == fleet.encode_body(_req(i))


def test_api_key_reaches_the_server_and_is_never_shown(monkeypatch):
    monkeypatch.setenv("COORDRL_TEST_DIRECT_KEY", SECRET)
    with FaultInjectingFakeServer() as server:
        server.fail_next("503")
        fleet = _fleet([server.url], api_key_env="COORDRL_TEST_DIRECT_KEY")
        (result,) = asyncio.run(_answer(fleet, [_req()]))
        assert result.ok and result.attempts == 2
        assert server.auth_headers == [f"Bearer {SECRET}"] * 2
    assert SECRET not in repr(fleet) + str(vars(fleet)) + repr(result)


@pytest.mark.parametrize(
    "faults",
    [("503",), ("500", "429"), ("drop",), ("500", "drop", "429"), ("400",), ("bad_json",), ("503", "400")],
)
def test_faults_cost_one_attempt_each(faults):
    with FaultInjectingFakeServer() as server:
        server.fail_next(*faults)
        (r,) = asyncio.run(_answer(_fleet([server.url], max_retries=3), [_req()]))
        assert server.chat_requests == r.attempts
    if "400" in faults or "bad_json" in faults:
        assert not r.ok and r.attempts == len(faults)
        assert r.error in ('HTTP 400: {"error": "injected fault"}', "malformed reply: {not json")
    else:
        assert r.ok and r.text == "Answer: question 0?" and r.attempts == len(faults) + 1


def test_timeout_cuts_a_hung_attempt_and_retries():
    with FaultInjectingFakeServer(hang_s=5.0) as server:
        server.fail_next("hang")
        (r,) = asyncio.run(_answer(_fleet([server.url], timeout_s=0.3, max_retries=2), [_req()]))
    assert r.ok and r.attempts == 2 and 0.3 <= r.latency_s < 2.0


def test_gives_up_with_the_last_error():
    with FaultInjectingFakeServer() as server:
        server.fault_always = "hang"
        server.hang_s = 5.0
        (r,) = asyncio.run(_answer(_fleet([server.url], timeout_s=0.2, max_retries=1), [_req()]))
    assert not r.ok and r.attempts == 2 and r.error == "timeout after 0.2s"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (r,) = asyncio.run(_answer(_fleet([f"http://127.0.0.1:{port}"], max_retries=1), [_req()]))
    assert not r.ok and r.attempts == 2
    assert r.error.startswith("ClientConnectorError: Cannot connect to host 127.0.0.1:")


def test_encoded_and_non_utf8_replies_decode():
    gz = gzip.compress(_chat("zipped ä"))
    replies = [
        _reply(200, gz, b"Content-Encoding: gzip\r\n"),
        _reply(400, "caf\xe9 refus\xe9".encode("latin-1"), b"Content-Type: text/plain; charset=latin-1\r\n"),
        _reply(502, b"\xff\xfe not utf-8"),
        _reply(200, b"[]"),
        _reply(404, b"nope", b"Content-Type: text/plain; charset=no-such-codec\r\n"),
    ]

    async def run() -> list[tuple]:
        async with RawServer(list(replies)) as srv:
            fleet = _fleet([srv.url], max_retries=0)
            results = []
            for i in range(len(replies)):
                (r,) = await fleet.answer([_req(i)])
                results.append((r.ok, r.text, r.error))
            await fleet.aclose()
            return results

    results = asyncio.run(run())
    assert results[0] == (True, "zipped ä", None)
    assert results[1][2] == "HTTP 400: café refusé"
    assert results[2][2].startswith("HTTP 502: \ufffd")
    assert results[3][2] == "malformed reply: []"
    assert results[4][2] == "HTTP 404: nope"


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


def test_non_ascii_api_key_fails_without_sending(monkeypatch):
    monkeypatch.setenv("COORDRL_TEST_DIRECT_KEY", "cl\u00e9")
    with FaultInjectingFakeServer() as server:
        fleet = _fleet([server.url], api_key_env="COORDRL_TEST_DIRECT_KEY")
        (r,) = asyncio.run(_answer(fleet, [_req()]))
        assert not r.ok and r.attempts == 1 and server.chat_requests == 0
    assert r.error.startswith("unexpected UnicodeEncodeError")


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.1])
def test_cancelled_batch_leaves_no_request_running(cancel_after_s):
    """Cancelled while its tasks are still being created (0 s) or while they wait on the server."""
    with FaultInjectingFakeServer(latency_s=1.0) as server:

        async def go():
            fleet = _fleet([server.url], max_concurrency=8)
            batch = asyncio.create_task(fleet.answer([_req(i) for i in range(100)]))
            await asyncio.sleep(cancel_after_s)
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
            await asyncio.sleep(0.05)
            assert asyncio.all_tasks() == {asyncio.current_task()}
            assert fleet._slots is not None and fleet._slots._free == 8
            await fleet.aclose()

        asyncio.run(go())
