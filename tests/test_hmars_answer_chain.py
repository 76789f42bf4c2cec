"""The HMARS answer role as a chain of reader queries (``answer_chain``): what the served chunk reader
receives (RecordingServer, real HTTP on loopback), failures counted as the answerer's, and the world
helpers the chain reads replies with. The served world reader itself answers in
tests/test_world_reader_vllm.py."""

from __future__ import annotations

import asyncio
import re

import pytest
from recording_server import RecordingServer, user_text

from coordrl.data.errors import DataError
from coordrl.data.hmars_world import HMARS_WORLD_ENV, earlier_born, hmars_world_splits, needed_titles
from coordrl.data.tokens import load_tokenizer
from coordrl.data.world import q_director
from coordrl.data.world_reader import READER_UNKNOWN, grounded, reply_value, world_documents
from coordrl.envs.hmars import HmarsEnvConfig, HmarsEnvFactory
from coordrl.envs.hmars_world import scripted_broadcast
from coordrl.readers.prompt import reader_messages

FILM_DOC = "Document 13:\nNuvol\nThe film Nuvol was directed by Mefi and filmed in Girer."
ORG_DOC = "Document 4:\nBofil\nBofil is an organisation based in Beba."


def test_reader_replies_are_read_only_when_copied_from_their_own_document():
    reply = "Nuvol: The film Nuvol was directed by Mefi and filmed in Girer."
    assert reply_value(reply, "director", "Nuvol") == "Mefi"
    assert reply_value(reply, "director", "Tamer") is None and reply_value(reply, "city", "Nuvol") is None
    assert reply_value("Mefi: In the decade of the 1930s Mefi was born.", "decade", "Mefi") == "1930s"
    assert reply_value(READER_UNKNOWN, "director", "Nuvol") is None
    assert grounded(reply, FILM_DOC)
    # A misreading seen from the kept reader on a filler document: a film sentence the document lacks.
    assert not grounded("Nuvol: The film Nuvol was directed by the and filmed in Beba.", ORG_DOC)
    assert not grounded(reply, ORG_DOC) and not grounded(READER_UNKNOWN, FILM_DOC)
    assert not grounded("Bofil: The film Nuvol was directed by Mefi and filmed in Girer.", FILM_DOC)  # other title
    # Whole documents only: a page that starts inside a document does not hand it to a reader.
    page = "filmed in Zano.\n\n" + FILM_DOC + "\n\n" + ORG_DOC
    assert world_documents(page) == [FILM_DOC, ORG_DOC]
    assert earlier_born(["A", "B"], "1950s", "1930s") == "B" and earlier_born(["A", "B"], "1930s", "1950s") == "A"
    assert earlier_born(["A", "B"], "1930s", "1930s") == earlier_born(["A", "B"], None, "1930s") == READER_UNKNOWN


def test_answer_chain_needs_a_served_reader():
    for answerer in ("rule", "lexical"):
        with pytest.raises(DataError, match=f"answer_chain needs .* got answerer '{answerer}'"):
            HmarsEnvConfig(answerer=answerer, answer_chain=True)
    with pytest.raises(DataError, match="answer_chain must be true or false"):
        HmarsEnvConfig(answerer="http://127.0.0.1:9", answer_chain="false")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def rows(tok):
    return hmars_world_splits(0, 4, seed=0, tokenizer=tok)["heldout"]


def _episode(url: str, tok, row) -> tuple[dict, str]:
    settings = {**HMARS_WORLD_ENV, "answerer": url, "answerer_model": "recorded", "answerer_api_key_env": None}
    factory = HmarsEnvFactory(HmarsEnvConfig(**settings, answer_chain=True), tokenizer=tok)
    try:
        env = factory()
        env.reset(**row)
        interpretation, hints = scripted_broadcast("good", row, env.index)
        reply = asyncio.run(env.broadcast(interpretation, hints))
        return env.info, reply
    finally:
        factory.close()


def test_the_served_reader_gets_each_selected_document_with_the_first_hop(tok, rows):
    bridge = next(r for r in rows if r["type"] == "bridge")
    film = needed_titles(bridge)[0]
    with RecordingServer() as server:
        info, reply = _episode(server.url, tok, bridge)
        readers = server.bodies("reader")
    assert server.bodies("answerer") == []  # no answer prompt: the reader is asked, one document at a time
    passages = [re.match(r"Passage:\n(.*)\n\nQuestion: ", user_text(b), re.DOTALL).group(1) for b in readers]
    # Exactly the reader prompt the fleet sends, with the first hop of the question.
    assert [b["messages"] for b in readers] == [reader_messages(p, q_director(film)) for p in passages]
    assert all(world_documents(p) == [p] for p in passages)  # one whole document per request
    film_doc = next(d for d in world_documents(bridge["context"]) if d.split("\n")[1] == film)
    assert film_doc in passages
    # The recording server's reply is no fact sentence: no director, so no second hop, and Unknown.
    assert f"Answer: {READER_UNKNOWN}" in reply.splitlines() and info["answerer_errors"] == 0
    assert info["answer_calls"] == 1 and info["em"] == 0.0


@pytest.mark.parametrize("fault", ["http500", "empty", "not_json"])
def test_a_failing_reader_is_the_answerer_s_counted_error(tok, rows, fault):
    with RecordingServer() as server:
        server.faults = {"reader": fault}
        info, reply = _episode(server.url, tok, rows[0])
    assert info["answerer_errors"] == 1 and info["em"] == 0.0 and info["backend_errors"] >= 1
    assert "Answer model unavailable: reader chain:" in reply  # the episode goes on and says why
