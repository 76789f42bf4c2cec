"""ChatEndpoint, the HMARS model client (card writer, selector, answer model), against loopback servers:
its own messages on the wire, replies unsanitised, retries, deadlines, failures returned per
conversation, routing, and make_chat_endpoint's spec."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from fault_injecting_server import FaultInjectingFakeServer

from coordrl.data.errors import DataError
from coordrl.readers.base import ReaderFleet
from coordrl.readers.chat_endpoint import ChatEndpoint, make_chat_endpoint

pytestmark = pytest.mark.timeout(60)


def _conv(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You select pages."}, {"role": "user", "content": f"Question: q{i}"}]


def _endpoint(urls: list[str], **kw) -> ChatEndpoint:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("api_key_env", None)
    return ChatEndpoint(urls, "selector-model", **kw)


async def _chat(ep: ChatEndpoint, conversations, keys=None):
    async with ep:
        return await ep.chat(conversations, keys)


def test_sends_each_conversation_and_keeps_the_reply_unsanitised():
    seen: list[dict] = []

    def reply(body: dict) -> str:
        seen.append(body)
        return (
            "<think>\nweighing\n</think>\n" + '<tool_call>{"pages": [1]}</tool_call> ' + body["messages"][-1]["content"]
        )

    with FaultInjectingFakeServer(responder=reply) as server:
        results = asyncio.run(_chat(_endpoint([server.url], max_tokens=9), [_conv(i) for i in range(5)]))
    # In order; the think block is dropped, the rest reaches the caller as the model wrote it.
    assert [r.text for r in results] == [f'<tool_call>{{"pages": [1]}}</tool_call> Question: q{i}' for i in range(5)]
    assert all(r.ok and r.attempts == 1 for r in results)
    assert sorted(b["messages"][-1]["content"] for b in seen) == [f"Question: q{i}" for i in range(5)]
    assert all(b["model"] == "selector-model" and b["max_tokens"] == 9 for b in seen)
    assert not isinstance(_endpoint(["http://127.0.0.1:9"]), ReaderFleet)


@pytest.mark.parametrize("faults", [("503",), ("500", "429"), ("drop",)])
def test_transient_faults_are_retried(faults):
    with FaultInjectingFakeServer() as server:
        server.fail_next(*faults)
        (r,) = asyncio.run(_chat(_endpoint([server.url], max_retries=3), [_conv(0)]))
        assert server.chat_requests == len(faults) + 1
    assert r.ok and r.attempts == len(faults) + 1 and r.text == "Answer: q0"


def test_failures_come_back_per_conversation_without_raising():
    with FaultInjectingFakeServer() as server:
        server.fail_next("400", "bad_json")  # the first two requests to arrive
        results = asyncio.run(
            _chat(_endpoint([server.url], max_concurrency=1, max_retries=2), [_conv(i) for i in range(3)])
        )
    assert [(r.ok, r.attempts) for r in results] == [(False, 1), (False, 1), (True, 1)]
    assert results[0].error == 'HTTP 400: {"error": "injected fault"}'
    assert results[1].error == "malformed reply: {not json"
    assert results[2].text == "Answer: q2"


def test_a_hung_attempt_is_cut_at_the_deadline_then_given_up():
    with FaultInjectingFakeServer(hang_s=5.0) as server:
        server.fault_always = "hang"
        t0 = time.perf_counter()
        (r,) = asyncio.run(_chat(_endpoint([server.url], timeout_s=0.2, max_retries=1, backoff_s=0.1), [_conv(0)]))
        elapsed = time.perf_counter() - t0
    assert not r.ok and r.attempts == 2 and r.error == "timeout after 0.2s"
    assert 0.5 <= elapsed < 2.0  # 2 x 0.2 s + 0.1 s of backoff, not the server's 5 s


def test_refused_connection_is_retried_then_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (r,) = asyncio.run(_chat(_endpoint([f"http://127.0.0.1:{port}"], max_retries=2), [_conv(0)]))
    assert not r.ok and r.attempts == 3 and "Cannot connect to host 127.0.0.1" in r.error


def test_keys_route_to_replicas_and_must_match_the_conversations():
    with FaultInjectingFakeServer() as a, FaultInjectingFakeServer() as b:
        ep = _endpoint([a.url, b.url])
        keys = [f"doc:card:{i}" for i in range(30)]
        results = asyncio.run(_chat(ep, [_conv(i) for i in range(30)], keys))
        assert all(r.ok for r in results)
        assert a.chat_requests == sum(ep.route(k) == a.url for k in keys)
        assert 0 < a.chat_requests < 30 and a.chat_requests + b.chat_requests == 30
    with pytest.raises(ValueError, match="2 conversations but 1 keys"):
        asyncio.run(_chat(ep, [_conv(0), _conv(1)], ["k"]))


def test_body_is_json_of_the_messages():
    ep = _endpoint(["http://127.0.0.1:9"], extra_body={"top_p": 0.5})
    body = json.loads(ep.encode_body(_conv(3)))
    assert body == {
        "model": "selector-model",
        "messages": _conv(3),
        "max_tokens": 512,
        "temperature": 0.0,
        "chat_template_kwargs": {"enable_thinking": False},
        "top_p": 0.5,
    }


def test_make_chat_endpoint_spec():
    assert make_chat_endpoint("lexical", None) is None
    assert make_chat_endpoint("", None) is None
    ep = make_chat_endpoint(" http://a:1/v1/ , https://b:2 ", "m", None, max_tokens=7, timeout_s=3.0)
    assert isinstance(ep, ChatEndpoint)
    assert (ep.urls, ep.model, ep.api_key_env, ep.max_tokens, ep.timeout_s) == (
        ["http://a:1", "https://b:2"],
        "m",
        None,
        7,
        3.0,
    )
    with pytest.raises(DataError, match="must be 'lexical' or comma-separated"):
        make_chat_endpoint("ftp://a", "m")
    with pytest.raises(DataError, match="needs the served model name"):
        make_chat_endpoint("http://a:1", None)
