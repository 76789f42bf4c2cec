"""The HMARS world (coordrl.data.hmars_world) and scripted broadcasts on it (coordrl.envs.hmars_world).

Lexical roles only (writer, selector) with the model-free rule answerer: a few dozen episodes, a few seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
from repo_scripts import defaults, load_script

from coordrl.data.chunk import chunk_context
from coordrl.data.errors import DataError
from coordrl.data.hmars_world import (
    HMARS_WORLD_ENV,
    HMARS_WORLD_SYSTEM_PROMPT,
    MAX_TITLES,
    N_DOCS,
    answer_from_evidence,
    document_number,
    hmars_world_splits,
    needed_titles,
    paragraphs,
)
from coordrl.data.tokens import load_tokenizer
from coordrl.data.world import make_world, q_director, world_rows, world_splits
from coordrl.data.world_reader import READER_UNKNOWN
from coordrl.envs.hmars import HmarsEnvConfig, HmarsEnvFactory
from coordrl.envs.hmars_index import TITLE_INDEX_CHARS, TITLE_INDEX_HEADER, _title_index_line
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


@pytest.fixture(scope="module")
def factory_with_map(tok):
    f = HmarsEnvFactory(HmarsEnvConfig(**{**HMARS_WORLD_ENV, "memory_map": True}), tokenizer=tok)
    use_rule_answerer(f)
    return f


@pytest.fixture(scope="module")
def factory_without_cards(tok):
    cfg = HmarsEnvConfig(**{**HMARS_WORLD_ENV, "memory_map": True, "memory_card_summaries": False})
    f = HmarsEnvFactory(cfg, tokenizer=tok)
    use_rule_answerer(f)
    return f


@pytest.fixture(scope="module")
def factory_whole_queries(tok):
    f = HmarsEnvFactory(HmarsEnvConfig(**{**HMARS_WORLD_ENV, "lexical_query_sentences": False}), tokenizer=tok)
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
            # The card of the film's sub-agent states the bridge (the mid-agent sees it with memory_card_summaries).
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


def test_good_broadcast_selects_the_supporting_pages_and_the_question_alone_misses_the_second_hop(
    splits, factory, factory_whole_queries
):
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
        # The second query alone names what the bridge lookup reads (the director) and finds his page; the
        # answer needs the first document too, which it selects only by chance (bridge 23% of held-out).
        only_second = _run(factory, row, *scripted_broadcast("second_hop", row, index))
        picked = {d for p in only_second.episode.stats.pages for d in index.pages[p].documents}
        assert second in picked
        if first_doc not in picked:
            assert only_second.info["em"] == 0.0 and only_second.answer == READER_UNKNOWN
        # The world scores each sentence of a query part alone (lexical_query_sentences): an interpretation
        # that asks both questions selects both pages wherever the hints go. Whole, the two questions
        # dilute each other and only a hint on the right sub-agent selects the page.
        for kind in ("misrouted", "interpretation_only", "restated"):
            sentences = _run(factory, row, *scripted_broadcast(kind, row, index))
            assert sentences.info["recall"] == 1.0 and sentences.info["em"] == 1.0, kind
        misrouted = _run(factory_whole_queries, row, *scripted_broadcast("misrouted", row, index))
        assert misrouted.info["recall"] < 1.0
        question = _run(factory_whole_queries, row, *scripted_broadcast("question", row, index))
        assert question.info["em"] == 0.0


def test_bridge_link_is_in_the_observation_only_with_memory_card_summaries(
    splits, factory, factory_with_map, factory_without_cards
):
    assert HMARS_WORLD_ENV["memory_card_summaries"] is True and HMARS_WORLD_ENV["memory_map"] is False
    bridges = [r for r in splits["heldout"] if r["type"] == "bridge"][:4]
    for i, row in enumerate(bridges):
        film, director = needed_titles(row)
        link = f"The film {film} was directed by {director}"
        world, with_map, without_cards = factory(), factory_with_map(), factory_without_cards()
        compact, memory, memory_alone = world.reset(**row), with_map.reset(**row), without_cards.reset(**row)
        index = with_map.index
        film_sub = owners(row, index)[0]
        # Cards off: the regional memory names the director (a title on its own sub-agent's line) but not
        # as the film's director; a reader of the observation stops at the first hop.
        assert director in memory_alone and link not in memory_alone
        interpretation, hints = broadcast_from_memory(row["question"], memory_alone)
        assert list(hints.values()) == [q_director(film)]
        # On: the film's sub-agent's card summary line states it, and the same reader routes both hops.
        (line,) = [x for x in memory.splitlines() if x.startswith(f"- s{film_sub}: ")]
        assert link in line
        good = scripted_broadcast("good", row, index)
        assert broadcast_from_memory(row["question"], memory) == good
        # The card summaries, one line per sub-agent, are the only difference between the two observations.
        lines = memory.split("\n")
        head = lines.index("Sub-agent card summaries (document text, not instructions):")
        block = lines[head + 1 : head + 1 + index.num_subagents]
        assert [x.split(":", 1)[0] for x in block] == [f"- s{s}" for s in range(index.num_subagents)]
        assert "\n".join(lines[:head] + lines[head + 1 + index.num_subagents :]) == memory_alone
        # The world's observation (no sub-agent map): the header, the same card summaries, the question;
        # the card titles route both hops as the entity lists did.
        top = next(n for n, x in enumerate(lines) if x.startswith("Regional memory"))
        assert compact == "\n".join([*lines[: top + 1], *lines[head : head + 1 + index.num_subagents], lines[-1]])
        assert "Sub-agents:" not in compact and "Cross-references:" not in compact
        assert broadcast_from_memory(row["question"], compact) == good
        if i == 0:
            assert _run(factory_without_cards, row, interpretation, hints).info["recall"] == 0.5
            assert _run(factory, row, *good).info["em"] == 1.0


def test_memory_map_off_needs_the_card_summaries():
    with pytest.raises(DataError, match="memory_map false needs memory_card_summaries"):
        HmarsEnvConfig(memory_map=False)
    with pytest.raises(DataError, match="memory_map must be true or false"):
        HmarsEnvConfig(memory_map="false", memory_card_summaries=True)


def test_title_index_names_the_subagent_holding_each_needed_document(splits, tok, factory_with_map):
    assert HmarsEnvConfig().memory_title_index is False and "memory_title_index" not in HMARS_WORLD_ENV
    # With the sub-agent map, whose entity lists the index is compared with.
    settings = {**HMARS_WORLD_ENV, "memory_map": True, "memory_title_index": True}
    indexed = HmarsEnvFactory(HmarsEnvConfig(**settings), tokenizer=tok)
    use_rule_answerer(indexed)
    mentioned_elsewhere = 0
    for row in splits["heldout"][:8]:
        env = indexed()
        # The question comes after the whole memory, the title index included.
        asked = "\nQuestion: " + row["question"]
        memory, without = env.reset(**row), factory_with_map().reset(**row)
        assert memory.endswith(asked) and without.endswith(asked)
        memory, without = memory.removesuffix(asked), without.removesuffix(asked)
        index = env.index
        # The index is one last line; everything before it is the observation without the setting.
        head, last = memory.rsplit("\n", 1)
        assert head == without and last.startswith(TITLE_INDEX_HEADER + " ")
        listed = dict(tuple(x.rsplit(" s", 1)) for x in last.removeprefix(TITLE_INDEX_HEADER + " ").split("; "))
        for title, sub in zip(needed_titles(row), owners(row, index), strict=True):
            assert listed[title] == str(sub)
            # The entity lists name a person on every sub-agent that mentions him; the index names one.
            on_lines = [x for x in without.splitlines() if x.startswith("- s") and "entities:" in x and title in x]
            mentioned_elsewhere += len(on_lines) > 1
    assert mentioned_elsewhere > 0
    # A region of hundreds of Documents: the line stops at its cap and says how many titles it left out.
    pairs = [(f"Title\nnumber {k}", k % 10) for k in range(1000)]
    line = _title_index_line(pairs)
    shown = line.removeprefix(TITLE_INDEX_HEADER + " ").split("; ")
    assert shown[0] == "Title number 0 s0" and shown[-1] == f"... ({1000 - len(shown) + 1} more)"
    assert len(line) <= len(TITLE_INDEX_HEADER) + 1 + TITLE_INDEX_CHARS + len(shown[-1]) + 2
    assert _title_index_line([]) == f"{TITLE_INDEX_HEADER} (none)"
    for name in ("memory_title_index", "lexical_query_sentences", "question_after_memory"):
        with pytest.raises(DataError, match=name):
            HmarsEnvConfig(**{name: "true"})


def test_question_after_memory_ends_the_observation(splits, tok, factory):
    assert HmarsEnvConfig().question_after_memory is False and HMARS_WORLD_ENV["question_after_memory"] is True
    without = HmarsEnvFactory(HmarsEnvConfig(**{**HMARS_WORLD_ENV, "question_after_memory": False}), tokenizer=tok)
    for row in splits["heldout"][:4]:
        memory, alone = factory().reset(**row), without().reset(**row)
        assert memory == alone + "\nQuestion: " + row["question"]
    # The repeated question passes the memory's marker filter: it cannot open a tool call in the observation.
    row = {**splits["heldout"][0], "question": "Who? <tool_call>{}</tool_call>"}
    assert "<tool_call>" not in factory().reset(**row).rsplit("\n", 1)[1]


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


# -- training on the HMARS world: the rule answer role by config, demonstrations, train data ----------


def test_answerer_rule_in_the_config_answers_from_the_selected_pages(splits, tok):
    from coordrl.envs.hmars_roles import RuleAnswerer

    f = HmarsEnvFactory(HmarsEnvConfig(**{**HMARS_WORLD_ENV, "answerer": "rule"}), tokenizer=tok)
    try:
        assert isinstance(f.backends.answerer, RuleAnswerer)
        row = next(r for r in splits["heldout"] if r["type"] == "bridge")
        for kind, em in (("good", 1.0), ("first_hop", 0.0)):
            env = f()
            env.reset(**row)
            asyncio.run(env.broadcast(*scripted_broadcast(kind, row, env.index)))
            assert env.get_reward() == em
            assert env.answer == (row["answers"][0] if em else READER_UNKNOWN)
        assert f.backends.answerer.calls == 2
    finally:
        f.close()


def test_demonstrations_render_the_broadcast_and_the_reported_answer_with_loss_on_assistant_turns(splits, tok):
    from coordrl.envs.chat import ChatCodec
    from coordrl.rollout.hmars_world import hmars_demo_ids, make_hmars_env_factory

    codec, f = ChatCodec(tok), make_hmars_env_factory(tok)
    try:
        row = next(r for r in splits["train"] if r["type"] == "comparison")
        for kind, answer in (("good", row["answers"][0]), ("first_hop", READER_UNKNOWN)):
            ids, mask = hmars_demo_ids(row, kind, codec, f)
            assert len(ids) == len(mask)
            learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
            seen = tok.decode(ids)
            assert '"name": "broadcast"' in learned and f"<answer> {answer}</answer>" in learned
            # The prompt (question, memory) and the tool result are in the sequence but never learned.
            assert row["question"] in seen and row["question"] not in learned
            assert "<tool_response>" in seen and "<tool_response>" not in learned
    finally:
        f.close()


def test_warm_start_demonstrations_do_not_depend_on_play_order_and_share_the_probed_prefix(splits, tok):
    # The builder plays a demonstration when it is first drawn. That trains the weights that playing all of
    # them first trained only if a demonstration depends on its question and kind alone, and if the prefix
    # it probes from the first bridge and the first comparison question is the one every demonstration shares.
    from coordrl.envs.chat import ChatCodec
    from coordrl.rollout.hmars_world import hmars_demo_ids, make_hmars_env_factory

    kinds = list(load_script("scripts/build_hmars_warm_start.py").BAD_KINDS)
    rows = splits["train"][:6]
    codec, f = ChatCodec(tok), make_hmars_env_factory(tok, lexical_query_sentences=False)
    try:
        ahead = {(k, i): hmars_demo_ids(rows[i], k, codec, f) for i in range(len(rows)) for k in kinds}
        drawn = {(k, i): hmars_demo_ids(rows[i], k, codec, f) for i in (4, 1, 5, 0, 3, 2) for k in reversed(kinds)}
    finally:
        f.close()
    assert drawn == ahead
    every = [ids for ids, _ in ahead.values()]
    shared = min(next(j for j, (x, y) in enumerate(zip(every[0], ids)) if x != y) for ids in every[1:])
    bridge, comparison = (next(i for i, r in enumerate(rows) if r["type"] == t) for t in ("bridge", "comparison"))
    a, b = ahead[kinds[0], bridge][0], ahead[kinds[0], comparison][0]
    assert next(j for j, (x, y) in enumerate(zip(a, b)) if x != y) == shared


def test_train_data_hmars_world_is_laid_out_with_the_policy_tokenizer_and_other_page_sizes_are_refused(tmp_path, tok):
    from coordrl.train.config import ConfigError, load_config
    from coordrl.train.run import _check_world_layout, _dataset

    cfg = load_config(
        "configs/hmars_world_cpu.yaml",
        {"output_dir": str(tmp_path), "world_train_size": "12", "world_heldout_size": "4"},
    )
    _check_world_layout(cfg)
    train = _dataset("hmars_world", cfg.coord, tmp_path, "train", tokenizer=tok)
    held = _dataset("hmars_world", cfg.coord, tmp_path, "eval", tokenizer=tok)
    assert (len(train), len(held)) == (12, 4)
    assert train[0]["prompt"][0]["content"] == cfg.coord.system_prompt == HMARS_WORLD_SYSTEM_PROMPT
    # The config trains under the world's settings (the warm start learned under them), plus its reward terms.
    assert {k: cfg.coord.hmars[k] for k in HMARS_WORLD_ENV} == HMARS_WORLD_ENV
    # The rows are the ones hmars_world_splits lays out with that tokenizer: every needed document
    # lies on one sub-agent under the configured regions and pages.
    expected = hmars_world_splits(12, 4, seed=0, tokenizer=tok)
    assert [r["context"] for r in held] == [r["context"] for r in expected["heldout"]]
    f = HmarsEnvFactory(cfg.env_config(), tokenizer=tok)
    try:
        env = f()
        env.reset(**train[0])
        assert len(set(owners(expected["train"][0], env.index))) == 2
    finally:
        f.close()
    block = {**cfg.coord.hmars, "page_tokens": 128}
    bad = load_config("configs/hmars_world_cpu.yaml", {"output_dir": str(tmp_path), "hmars": block})
    with pytest.raises(ConfigError, match=r"hmars\.page_tokens"):
        _check_world_layout(bad)


def test_learning_check_hmars_refuses_the_parser_only_options(capsys):
    check = load_script("benchmarks/learning_check.py")
    assert check.SETUPS["hmars"].config.name == "hmars_world_cpu.yaml" and check.SETUPS["hmars"].config.exists()
    for extra in (["--ablations"], ["--ablations-only"]):
        with pytest.raises(SystemExit) as exc:
            check.main(["--protocol", "hmars", "--out", "/nonexistent/never-written", *extra])
        assert exc.value.code == 2
        assert "--protocol hmars" in capsys.readouterr().err


def test_learning_check_hmars_through_a_served_answer_role(tmp_path):
    # --readers vllm makes the served world reader the HMARS answer role (answer_chain) over the config's
    # HMARS settings; the targets stay HMARS's, and --resume matches runs whatever port the server got.
    import argparse

    from coordrl.train.config import load_config

    check = load_script("benchmarks/learning_check.py")
    role = {"answerer": "http://127.0.0.1:1", "answerer_model": "m", "answerer_api_key_env": None, "answer_chain": True}
    overrides = check.served_answer_overrides({"beta": "0.04"}, role)
    cfg = load_config(check.SETUPS["hmars"].config, {"output_dir": str(tmp_path), **overrides})
    assert cfg.coord.hmars == {**load_config(check.SETUPS["hmars"].config).coord.hmars, **role}
    assert cfg.grpo["beta"] == 0.04 and cfg.env_config("m").answer_chain is True
    assert (
        check.setup_for("hmars", "vllm") == check.SETUPS["hmars"] and check.default_steps(None, "vllm", "hmars") is None
    )
    assert check.setup_for("parser", "vllm").target_sampled == check.SERVED_READER_TARGETS["target_sampled"]
    a = argparse.Namespace(protocol="hmars", readers="vllm", steps=70, minutes=None, eval_n=100)
    moved = check.served_answer_overrides({"beta": "0.04"}, {**role, "answerer": "http://127.0.0.1:2"})
    assert check.run_identity(a, overrides, "w" * 64) == check.run_identity(a, moved, "w" * 64)
    other = check.served_answer_overrides({"beta": "0.1"}, role)
    assert check.run_identity(a, overrides, "w" * 64) != check.run_identity(a, other, "w" * 64)
    # The served reader's folder is held relative to the repository: a clone elsewhere resumes the same run.
    kept = check.served_answer_overrides({}, {**role, "answerer_model": str(check.READER_MODEL)})
    held = json.loads(check.run_identity(a, kept, "w" * 64)["overrides"]["hmars"])
    assert held["answerer_model"] == "src/coordrl/resources/world_reader" and held["answerer"] == "served"
    assert check.warm_start_settings(check.setup_for("hmars", "vllm"), role, overrides) == {}


def test_kept_hmars_warm_start_resolves_and_shares_the_world_tokenizer():
    from transformers import AutoTokenizer

    from coordrl.rollout.models import HMARS_WORLD_MODEL, WORLD_MODEL, resolve_model

    folder = Path(resolve_model(HMARS_WORLD_MODEL))
    meta = json.loads((folder / "coordrl_warm_start.json").read_text())
    assert (folder / "model.safetensors").stat().st_size < 15e6
    # Deliberately imperfect: built with some bad demonstrations, inside the 25-45% sampled design window,
    # and in the world's observation (the question after the memory).
    assert meta["p_good"] < 1 and 0.25 <= meta["heldout_sampled"]["all"] <= 0.45
    assert meta["env"]["question_after_memory"] is True
    world = AutoTokenizer.from_pretrained(resolve_model(WORLD_MODEL))
    assert AutoTokenizer.from_pretrained(str(folder)).get_vocab() == world.get_vocab()


def test_hmars_warm_start_rate_warms_up_then_decays_to_its_end():
    lr_at = load_script("scripts/build_hmars_warm_start.py").lr_at
    assert [lr_at(s, 100, lr=1.0, warmup=10, lr_end=None) for s in (1, 5, 10, 11, 100)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    decayed = [lr_at(s, 100, lr=1.0, warmup=10, lr_end=0.1) for s in range(10, 101)]
    assert decayed[0] == 1.0 and decayed[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(decayed))


def test_kept_hmars_warm_start_is_what_the_builder_builds_by_default():
    from coordrl.rollout.models import HMARS_WORLD_MODEL, resolve_model

    mod = load_script("scripts/build_hmars_warm_start.py")
    meta = json.loads((Path(resolve_model(HMARS_WORLD_MODEL)) / "coordrl_warm_start.json").read_text())
    built_with = defaults(mod.build)
    assert meta["bad_kinds"] == mod.BAD_KINDS and meta["bridge_kinds"] == mod.BRIDGE_KINDS
    for key in ("seed", "steps", "p_good", "n_train", "lr", "batch", "warmup", "name_weight"):
        assert meta[key] == built_with[key], key
    # Builds from before the rate could decay say nothing of lr_end: their rate was constant.
    assert meta.get("lr_end") == built_with["lr_end"]


def test_learning_check_records_which_warm_start_it_started_from():
    import hashlib

    from coordrl.rollout.models import HMARS_WORLD_MODEL, resolve_model

    check = load_script("benchmarks/learning_check.py")
    kept = Path(resolve_model(HMARS_WORLD_MODEL))
    record = check.warm_start_record(kept)
    assert record["path"] == "src/coordrl/resources/hmars_warm_start"
    assert record["sha256"] == hashlib.sha256((kept / "model.safetensors").read_bytes()).hexdigest()
    meta = json.loads((kept / "coordrl_warm_start.json").read_text())
    assert record["recipe"]["steps"] == meta["steps"] and "history" not in record["recipe"]


def test_lookup_benchmark_stops_each_broadcast_just_before_the_name_read_from_the_memory(splits):
    # benchmarks/hmars_lookup.py reads the policy's next-token distribution where the second query's name
    # goes: the director for a bridge question (the question never names them), the other person for a
    # comparison. A prefix cut one token off would measure something else.
    from transformers import AutoTokenizer

    from coordrl.rollout.models import HMARS_WORLD_MODEL, resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(HMARS_WORLD_MODEL))
    bench = load_script("benchmarks/hmars_lookup.py")
    with pytest.raises(ValueError, match="tokens; use a world policy"):
        bench.lookup_prefixes(load_tokenizer(None), 2)
    prefixes = bench.lookup_prefixes(tok, 4)
    rows = splits["heldout"][:4]
    assert [kind for kind, _, _ in prefixes] == [row["type"] for row in rows]
    for (kind, ids, name_id), row in zip(prefixes, rows, strict=True):
        name = needed_titles(row)[1]
        assert tok.decode([name_id]).strip() == name and name not in tok.decode(ids).split("<|im_start|>assistant")[-1]
        head = "In which city was" if kind == "bridge" else "In which decade was"
        assert tok.decode(ids).endswith(f"? {head}"), tok.decode(ids[-12:])
        if kind == "bridge":
            assert name not in row["question"]


def test_warm_start_builder_draws_each_question_types_kinds_from_its_own_mix():
    import random

    draw = load_script("scripts/build_hmars_warm_start.py").draw
    train = [{"type": "bridge"}, {"type": "comparison"}] * 50
    mixes = {"bridge": {"interpretation_only": 0.6, "first_hop": 0.4}, "comparison": {"question": 1.0}}
    rng = random.Random(0)
    drawn = [draw(rng, train, 0.0, mixes) for _ in range(400)]
    by_type = {t: [k for k, i in drawn if train[i]["type"] == t] for t in mixes}
    assert set(by_type["comparison"]) == {"question"}
    assert set(by_type["bridge"]) == {"interpretation_only", "first_hop"}
    assert 0.5 < by_type["bridge"].count("interpretation_only") / len(by_type["bridge"]) < 0.7
    assert {k for k, _ in (draw(random.Random(1), train, 1.0, mixes) for _ in range(5))} == {"good"}


def test_warm_start_builder_refuses_an_unknown_kind_or_weightless_mix_naming_the_flag():
    check = load_script("scripts/build_hmars_warm_start.py").check_kinds
    check(bad_kinds={"question": 1.0}, bridge_kinds={"interpretation_only": 0.5, "first_hop": 0.5})
    with pytest.raises(
        ValueError, match=r"bridge_kinds \(--bridge-kinds\): unknown broadcast kind\(s\) \['frist_hop'\]"
    ):
        check(bad_kinds={"question": 1.0}, bridge_kinds={"frist_hop": 1.0})
    with pytest.raises(ValueError, match=r"bad_kinds \(--bad-kinds\): weights must be"):
        check(bad_kinds={"question": 0.0})
