"""The HMARS world (coordrl.data.hmars_world) and scripted broadcasts on it (coordrl.envs.hmars_world).

Lexical roles only (writer, selector) with the model-free rule answerer: a few dozen episodes, a few seconds.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from coordrl.data.chunk import chunk_context
from coordrl.data.hmars_world import (
    HMARS_WORLD_ENV,
    MAX_TITLES,
    N_DOCS,
    answer_from_evidence,
    document_number,
    hmars_world_splits,
    needed_titles,
    paragraphs,
)
from coordrl.data.tokens import load_tokenizer
from coordrl.data.world import make_world, world_rows, world_splits
from coordrl.data.world_reader import READER_UNKNOWN
from coordrl.envs.hmars import HmarsEnvConfig, HmarsEnvFactory
from coordrl.envs.hmars_world import (
    broadcast_from_memory,
    memory_entities,
    owners,
    scripted_broadcast,
    use_rule_answerer,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def splits(tok):
    return hmars_world_splits(60, 20, seed=0, tokenizer=tok)


@pytest.fixture(scope="module")
def factory(tok):
    f = HmarsEnvFactory(HmarsEnvConfig(**HMARS_WORLD_ENV), tokenizer=tok)
    use_rule_answerer(f)
    return f


def _key(row):
    chain = json.loads(row["chain"])
    if row["type"] == "bridge":
        return ("bridge", chain["film"], chain["director"], row["answers"][0])
    return ("comparison", *sorted(chain["people"]))


def test_world_is_seeded_reuses_the_parser_questions_and_keeps_heldout_chains_out_of_training(splits, tok):
    assert hmars_world_splits(60, 20, seed=0, tokenizer=tok) == splits
    held, train = splits["heldout"], splits["train"]
    assert not {_key(r) for r in held} & {_key(r) for r in train}
    # The same questions and answers as the PARSER world's splits, with other documents.
    parser = world_splits(60, 20, seed=0)
    for ours, theirs in zip(held + train, parser["heldout"] + parser["train"], strict=True):
        assert (ours["id"], ours["question"], ours["answers"], ours["chain"]) == (
            theirs["id"],
            theirs["question"],
            theirs["answers"],
            theirs["chain"],
        )
        assert "chunks" not in ours and len(ours["doc_offsets"]) == N_DOCS
    # Laying out only re-orders the padded PARSER documents.
    padded, _ = world_rows(20, 0, make_world(0), prefix="heldout", n_docs=N_DOCS)
    for ours, theirs in zip(held, padded, strict=True):
        assert Counter(paragraphs(ours)) == Counter(paragraphs(theirs))
    assert sum(ours["context"] != theirs["context"] for ours, theirs in zip(held, padded, strict=True)) > 10
    assert Counter(r["type"] for r in held) == {"bridge": 10, "comparison": 10}


def test_layout_puts_each_needed_document_whole_on_its_own_sub_agent(splits, tok):
    per = HMARS_WORLD_ENV["c_sub"] // HMARS_WORLD_ENV["page_tokens"]
    for row in splits["heldout"] + splits["train"][:20]:
        needed = [document_number(row, t) for t in needed_titles(row)]
        assert sorted(needed) == row["gold_documents"]
        for d in row["gold_documents"]:
            assert row["context"][row["doc_offsets"][d - 1] :].startswith(f"Document {d}:\n")
        pages = chunk_context(row["context"], tok, HMARS_WORLD_ENV["page_tokens"], row["doc_offsets"])
        homes = [[p.index for p in pages if d in p.documents] for d in needed]
        assert all(len(h) == 1 for h in homes) and homes[0][0] // per != homes[1][0] // per
        n_sub = -(-len(pages) // per)
        assert 3 <= n_sub <= HMARS_WORLD_ENV["group_size"]  # several sub-agents, one mid-agent
        titles = Counter(
            next(p.index for p in pages if p.char_start <= off < p.char_end) // per for off in row["doc_offsets"]
        )
        assert max(titles.values()) <= MAX_TITLES


def test_index_cards_and_regional_memory_hold_what_a_good_broadcast_needs(splits, factory):
    for row in splits["heldout"]:
        env = factory()
        memory = env.reset(**row)
        index = env.index
        assert index.num_regions == 1 and env.info["gold_in_region"] == 1.0
        names, subs = needed_titles(row), owners(row, index)
        lists = memory_entities(memory)
        for name, sub in zip(names, subs, strict=True):
            assert name in index.cards[sub].entities and name in lists[sub]  # routing is readable
        summaries = {s: index.cards[s].summary for s in subs}
        if row["type"] == "bridge":
            film, director = names
            # The card of the film's sub-agent states the bridge (shown to model selectors, not to the mid-agent).
            assert f"{film}: The film {film} was directed by {director}" in summaries[subs[0]]
            assert f"{director}: {director} was born in the city of {row['answers'][0]}." in summaries[subs[1]]
        else:
            # Comparison needs no bridge: the memory's entity lists route both names.
            assert broadcast_from_memory(row["question"], memory) == scripted_broadcast("good", row, index)


def _run(factory, row, interpretation, hints):
    env = factory()
    env.reset(**row)
    reply = asyncio.run(env.broadcast(interpretation, hints))
    assert not reply.startswith("Error"), reply
    return env


def test_good_broadcast_selects_the_supporting_pages_and_the_question_alone_misses_the_second_hop(splits, factory):
    rows = splits["heldout"][:6]  # three of each type
    for row in rows:
        env = factory()
        env.reset(**row)
        index = env.index
        good = _run(factory, row, *scripted_broadcast("good", row, index))
        assert good.info["recall"] == 1.0 and good.info["em"] == 1.0 and good.answer == row["answers"][0]
        question = _run(factory, row, *scripted_broadcast("question", row, index))
        second = document_number(row, needed_titles(row)[1])
        picked = {d for p in question.episode.stats.pages for d in index.pages[p].documents}
        assert second not in picked and question.info["recall"] < 1.0 and question.info["em"] == 0.0
        assert question.answer == READER_UNKNOWN
        first = _run(factory, row, *scripted_broadcast("first_hop", row, index))
        first_doc = document_number(row, needed_titles(row)[0])
        assert first_doc in {d for p in first.episode.stats.pages for d in index.pages[p].documents}
        misrouted = _run(factory, row, *scripted_broadcast("misrouted", row, index))
        assert misrouted.info["recall"] < 1.0


def test_bridge_from_memory_needs_the_director_in_the_observation(splits, factory):
    row = next(r for r in splits["heldout"] if r["type"] == "bridge")
    env = factory()
    memory = env.reset(**row)
    index = env.index
    film = needed_titles(row)[0]
    good = scripted_broadcast("good", row, index)
    # The lexical regional memory names the director (a title on its sub-agent's line) but not as the
    # film's director: a reader of the memory alone stops at the first hop.
    if f"The film {film} was directed by" not in memory:
        interpretation, hints = broadcast_from_memory(row["question"], memory)
        assert list(hints.values()) == [f"Who directed the film {film}?"]
        assert _run(factory, row, interpretation, hints).info["recall"] == 0.5
    # With the sub-agents' card summaries in view, the same reader routes both hops.
    with_cards = memory + "\n" + "\n".join(f"- s{s}: {c.summary}" for s, c in enumerate(index.cards))
    assert broadcast_from_memory(row["question"], with_cards) == good
    assert _run(factory, row, *good).info["em"] == 1.0


def test_rule_answerer_follows_the_chain_and_never_guesses(splits):
    row = next(r for r in splits["heldout"] if r["type"] == "bridge")
    docs = {p.title: p for p in paragraphs(row)}
    film, director = needed_titles(row)

    def text(*titles):
        return "\n\n".join(f"Document {i}:\n{docs[t].text}" for i, t in enumerate(titles, 1))

    assert answer_from_evidence(row["question"], text(film, director)) == row["answers"][0]
    assert answer_from_evidence(row["question"], text(director)) == READER_UNKNOWN
    assert answer_from_evidence(row["question"], text(film)) == READER_UNKNOWN
    row = next(r for r in splits["heldout"] if r["type"] == "comparison")
    docs = {p.title: p for p in paragraphs(row)}
    p1, p2 = needed_titles(row)
    assert answer_from_evidence(row["question"], text(p2, p1)) == row["answers"][0]
    assert answer_from_evidence(row["question"], text(p1)) == READER_UNKNOWN
    assert answer_from_evidence("What is the capital of France?", text(p1, p2)) == READER_UNKNOWN
