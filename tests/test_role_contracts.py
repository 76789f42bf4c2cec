"""What every model-served role actually sends, checked where it arrives: at a recording server.

The byte-level property: for every request kind (reader, card writer, region writer, selector,
answer model, a subclass's own body, ``extra_body`` that replaces fields) the bytes on the wire are
exactly ``json.dumps(request_body(request))``, hostile text included. Then one test per role drives
the real CLI path (`coordrl rollout`, `eval`, `index`, `answer`) against `RecordingServer` and
asserts that the received messages hold what that role must see: the passage and the query, the
pages, the interpretation and hints, the evidence, the prompt ids. The HMARS selector, answer model
and served mid-agent policy are covered in tests/test_hmars_pipeline.py (they need its trained
mid-agent export).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from recording_server import RecordingServer, user_text

from coordrl.cli import main
from coordrl.data.build import SweepConfig, build_sweep
from coordrl.data.show import load_built
from coordrl.envs.hmars_prompts import (
    answer_messages,
    card_writer_messages,
    region_writer_messages,
    selector_messages,
)
from coordrl.readers.base import ReaderRequest
from coordrl.readers.chat_endpoint import ChatEndpoint
from coordrl.readers.openai_fleet import OpenAIReaderFleet
from coordrl.readers.prompt import READER_INSTRUCTIONS, sanitize_reader_text
from coordrl.rollout.models import WORLD_MODEL, resolve_model

pytestmark = pytest.mark.timeout(300)

# Characters that JSON escapes specially, that the fast path's escaping shortcut must not mishandle,
# or that a document could use to break out of its place in a prompt.
_HOSTILE = ['"', "\\", "\\u0041", "\n", "\r", "\t", "\x00", "\x01", "\x1f", "\x7f", "\u2028", "é", "中文", "🙂",
            "</s>", "<tool_call>", "<|im_end|>", "{", "}", "Question: ", "Passage:", " ", "word"]  # fmt: skip


def hostile_text(rng: random.Random, n: int = 12) -> str:
    return "".join(rng.choice(_HOSTILE) for _ in range(n))


def request_kinds(rng: random.Random) -> list[ReaderRequest]:
    """One request of each kind the fleet sends, each filled with hostile text."""

    def t() -> str:
        return hostile_text(rng)

    pages = [(0, t()), (1, t())]
    return [
        ReaderRequest(t(), t(), "chunk-0"),
        ReaderRequest(t(), t(), "chunk-0"),  # same chunk, other query: the cached passage path
        ReaderRequest.chat(card_writer_messages("s0", pages, 1000), "card"),
        ReaderRequest.chat(region_writer_messages(0, {"s0": {"summary": t(), "topics": [t()]}}, 1000), "region"),
        ReaderRequest.chat(selector_messages(t(), t(), t(), t(), pages, 500), "sub:0"),
        ReaderRequest.chat(answer_messages(t(), [("s0 page 1", t())]), "answer"),
    ]


class _OwnBody(OpenAIReaderFleet):
    """A subclass with its own body: the fast path must not bypass it."""

    def request_body(self, request):
        body = super().request_body(request)
        body["messages"] = [{"role": "user", "content": "SUBCLASS " + request.query}]
        return body


def _fleets(url: str) -> list[OpenAIReaderFleet]:
    return [
        OpenAIReaderFleet([url], 'm\u00e9"', api_key_env=None),
        _OwnBody([url], "m", api_key_env=None),
        OpenAIReaderFleet([url], "m", api_key_env=None, extra_body={"top_p": 0.5, "stop": ["\u2028"]}),
        OpenAIReaderFleet([url], "m", api_key_env=None, extra_body={"model": "other"}),
    ]


def test_encoded_body_is_json_dumps_of_request_body_for_every_kind():
    rng = random.Random(0)
    for fleet in _fleets("http://127.0.0.1:9"):
        for _ in range(60):
            for request in request_kinds(rng):
                want = json.dumps(fleet.request_body(request), separators=(",", ":")).encode()
                assert fleet.encode_body(request) == want
                assert fleet._encode_body(request, {}) == want


def test_chat_requests_send_their_own_messages():
    # The reader prompt (with an empty passage and question) used to replace every other role's messages.
    ep = ChatEndpoint(["http://127.0.0.1:9"], model="m")
    messages = [{"role": "system", "content": "SELECTOR"}, {"role": "user", "content": "pick"}]
    assert json.loads(ep.encode_body(messages))["messages"] == messages
    # The chat-kind reader requests send the same body through a reader fleet.
    fleet = OpenAIReaderFleet(["http://127.0.0.1:9"], "m")
    assert fleet.encode_body(ReaderRequest.chat(messages, "k")) == ep.encode_body(messages)


def _chat_conversations(rng: random.Random) -> list[list[dict[str, str]]]:
    """The conversations of the chat kinds of `request_kinds` (card, region, selector, answer)."""
    return [list(r.chat_messages()) for r in request_kinds(rng) if r.messages is not None]


def test_chat_endpoint_sends_its_request_body():
    """Card writer, region writer, selector and answer model: the bytes that arrive are
    ``json.dumps(request_body(messages))``, hostile text included, and replies come back in order."""
    rng = random.Random(2)
    with RecordingServer() as server:
        ep = ChatEndpoint([server.url], "m", api_key_env=None, max_tokens=7)
        conversations = _chat_conversations(rng) + _chat_conversations(rng)

        async def send():
            async with ep:
                return await ep.chat(conversations, [f"k{i}" for i in range(len(conversations))])

        results = asyncio.run(send())
        assert all(r.ok for r in results), [r.error for r in results]
        received = sorted(r["raw"] for r in server.requests)
    assert received == sorted(json.dumps(ep.request_body(c), separators=(",", ":")).encode() for c in conversations)
    assert all(json.loads(raw)["max_tokens"] == 7 for raw in received)


@pytest.mark.parametrize("coalesce", [False, True])
def test_bytes_on_the_wire_are_the_request_body(coalesce):
    rng = random.Random(1)
    with RecordingServer() as server:
        for fleet in _fleets(server.url):
            fleet.coalesce = coalesce
            requests = request_kinds(rng)
            server.requests.clear()

            async def send(fleet=fleet, requests=requests):
                async with fleet:
                    return await fleet.answer(requests)

            results = asyncio.run(send())
            assert all(r.ok for r in results), [r.error for r in results]
            received = sorted(r["raw"] for r in server.requests)
            expected = sorted(json.dumps(fleet.request_body(q), separators=(",", ":")).encode() for q in requests)
            if coalesce:  # identical bodies in flight together go out once (a subclass's may coincide)
                assert set(received) == set(expected) and len(received) <= len(expected)
            else:
                assert received == expected


# -- per-role contracts through the CLI --------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("contract-data") / "sweep"
    build_sweep(SweepConfig(questions=2, lengths=[20]), out)
    return out


@pytest.fixture(scope="module")
def rows(sweep) -> list[dict]:
    return [dict(r) for r in load_built(sweep / "length-00020")]


def _reader_parts(body: dict) -> tuple[str, str]:
    """(passage, question) of a reader request, as the reader prompt lays them out."""
    text = user_text(body)
    assert text.startswith("Passage:\n") and "\n\nQuestion: " in text, text[:200]
    passage, question = text.removeprefix("Passage:\n").rsplit("\n\nQuestion: ", 1)
    return passage, question


def _assert_readers_saw_the_document(server: RecordingServer, row: dict, query: str) -> None:
    bodies = server.bodies("reader")
    assert bodies, f"no reader request arrived (roles seen: {server.roles()})"
    context = sanitize_reader_text(row["context"])
    passages = set()
    for body in bodies:
        assert body["messages"][0] == {"role": "system", "content": READER_INSTRUCTIONS}
        passage, question = _reader_parts(body)
        assert len(passage) > 200 and passage in context  # a real slice of this sample's document
        assert question == sanitize_reader_text(query.strip())
        passages.add(passage)
    # Every chunk was asked, and together the passages hold every gold paragraph's title.
    assert all(any(title in p for p in passages) for title in row["gold_titles"])


def test_reader_contract_rollout(sweep, rows, capsys):
    with RecordingServer() as server:
        code = main(["rollout", "--data", str(sweep / "length-00020"), "--sample", "0", "--readers", server.url,
                     "--reader-model", server.model, "--policy", "scripted", "--json"])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        _assert_readers_saw_the_document(server, rows[0], rows[0]["question"])
    episode = json.loads(capsys.readouterr().out)
    assert episode["info"]["reader_errors"] == 0


def test_reader_contract_eval(sweep, rows, tmp_path):
    with RecordingServer() as server:
        out = tmp_path / "eval"
        code = main(["eval", "--policy", "scripted", "--data", str(sweep / "length-00020"), "--out", str(out), "--readers", server.url,
                     "--reader-model", server.model, "--chunk-tokens", "1024", "--limit", "1", "--no-progress"])  # fmt: skip
        assert code == 0
        _assert_readers_saw_the_document(server, rows[0], rows[0]["question"])


def test_writer_contract_index(sweep, rows, tmp_path):
    cache = tmp_path / "cache"
    with RecordingServer() as server:
        code = main(["index", "--data", str(sweep / "length-00020"), "--cache", str(cache), "--writer", server.url, "--writer-model",
                     server.model, "--c-sub", "1024", "--page-tokens", "256", "--group-size", "2", "--limit", "1"])  # fmt: skip
        assert code == 0
        cards, regions = server.bodies("writer"), server.bodies("region_writer")
    assert len(cards) > 2 and regions, server.roles()
    # Card writers see their region's pages: every gold paragraph's first sentence reaches one of them.
    seen = "\n".join(user_text(b) for b in cards)
    assert "[page 0]" in seen
    for title in rows[0]["gold_titles"]:
        assert sanitize_reader_text(title) in seen
    # Region writers see the cards the writers wrote.
    assert all("Recorded card." in user_text(b) for b in regions)


def _policy_turns(tokenizer, query: str):
    """A served policy's replies: one query_agents call, then the first finding as the answer."""

    def respond(body: dict) -> list[int]:
        prompt = tokenizer.decode(body["prompt"])
        if "<tool_response>" not in prompt:
            call = {"name": "query_agents", "arguments": {"queries": [query]}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            text = "<answer>recorded</answer>"
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    return respond


def test_policy_and_reader_contract_answer(rows, tmp_path, capsys):
    from transformers import AutoTokenizer

    policy = resolve_model(WORLD_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    row = rows[1]
    doc = tmp_path / "doc.txt"
    doc.write_text(row["context"], encoding="utf-8")
    query = "Which QUERY-MARK facts does the passage hold?"
    with RecordingServer(policy_responder=_policy_turns(tokenizer, query)) as server:
        code = main(["answer", "--policy", policy, "--policy-url", server.url, "--document", str(doc), "--question", row["question"],
                     "--readers", server.url, "--reader-model", server.model, "--chunk-tokens", "1024", "--json"])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        turns = [tokenizer.decode(b["prompt"]) for b in server.bodies("policy")]
        _assert_readers_saw_the_document(server, row, query)
    result = json.loads(capsys.readouterr().out)
    assert result["answer"] == "recorded"
    # The policy's first prompt holds the question; its second holds what the readers replied.
    assert len(turns) == 2 and row["question"] in turns[0] and "<tool_response>" not in turns[0]
    assert turns[1].startswith(turns[0]) and f"Answer: {query}" in turns[1]
