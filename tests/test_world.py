"""The synthetic multi-hop world (coordrl.data.world) and its tokenizer."""

import hashlib
import json

import pytest
from repo_scripts import defaults, load_script

from coordrl.data.world import (
    DECADES,
    QUESTION_TYPES,
    build_world_dataset,
    make_world,
    scripted_turns,
    world_splits,
)
from coordrl.rollout.world import (
    build_world_tokenizer,
    demo_ids,
    make_env_factory,
    with_world_prompt,
)


@pytest.fixture(scope="module")
def tok():
    return build_world_tokenizer(seed=0)


def test_world_is_seeded_and_heldout_chains_are_unseen():
    a, b = world_splits(300, 40, seed=0), world_splits(300, 40, seed=0)
    assert a == b
    assert world_splits(50, 10, seed=1)["heldout"] != a["heldout"][:10]
    w = make_world(0)
    assert len(set(w.names)) == len(w.names)

    def key(r):
        c = json.loads(r["chain"])
        return (
            (r["type"], c.get("film"), c.get("director"), r["answers"][0])
            if r["type"] == "bridge"
            else (r["type"], *sorted(c["people"]))
        )

    assert not {key(r) for r in a["heldout"]} & {key(r) for r in a["train"]}
    assert {r["type"] for r in a["train"]} == set(QUESTION_TYPES)
    for r in a["train"][:50]:
        for d in r["gold_documents"]:
            start = r["doc_offsets"][d - 1]
            assert r["context"][start:].startswith(f"Document {d}:\n")
        chain = json.loads(r["chain"])
        if r["type"] == "bridge":
            assert (
                f"The film {chain['film']} was directed by {chain['director']} and filmed in {chain['decoy']}."
                in r["context"]
            )
            assert f"{chain['director']} was born in the city of {r['answers'][0]}." in r["context"]
        else:
            d1, d2 = chain["decades"]
            assert r["answers"][0] == chain["people"][0 if d1 < d2 else 1] and d1 != d2
            assert f"In the decade of the {d1}s {chain['people'][0]} was born." in r["context"]


def test_one_document_per_chunk_cuts_the_same_questions_into_single_document_chunks(tmp_path):
    from coordrl.data.world_reader import chunk_facts

    two, one = world_splits(40, 10, seed=0), world_splits(40, 10, seed=0, docs_per_chunk=1)
    for split in ("train", "heldout"):
        for a, b in zip(two[split], one[split], strict=True):
            assert {k: v for k, v in a.items() if not k.startswith("chunk")} == {
                k: v for k, v in b.items() if not k.startswith("chunk")
            }
            assert b["chunk_documents"] == [[i + 1] for i in range(len(a["doc_offsets"]))]
            assert "\n\n".join(b["chunks"]) == "\n\n".join(a["chunks"])
            assert all(c.count("Document ") == 1 for c in b["chunks"])
            # No chunk holds two facts of one relation: a reader never has to tell them apart.
            for chunk in b["chunks"]:
                relations = [relation for relation, _ in chunk_facts(chunk)]
                assert len(relations) == len(set(relations))
    assert any(len(c["chunk_documents"][0]) == 2 for c in two["train"])  # the default is unchanged
    meta = tmp_path / "w1"
    build_world_dataset(meta, n_train=4, n_heldout=2, seed=0, docs_per_chunk=1)
    assert json.loads((meta / "world.json").read_text())["docs_per_chunk"] == 1
    with pytest.raises(ValueError, match="docs_per_chunk"):
        build_world_dataset(tmp_path / "w0", n_train=4, n_heldout=2, docs_per_chunk=0)


def test_mixed_training_lengths_pad_the_same_training_questions_and_leave_heldout_alone(tmp_path):
    plain, mixed = world_splits(60, 10, seed=0), world_splits(60, 10, seed=0, train_docs=[8, 32, 64])
    assert mixed["heldout"] == plain["heldout"]
    for a, b in zip(plain["train"], mixed["train"], strict=True):
        assert (a["id"], a["question"], a["answers"], a["chain"]) == (b["id"], b["question"], b["answers"], b["chain"])
    lengths = [len(r["doc_offsets"]) for r in mixed["train"]]
    assert set(lengths) == {8, 32, 64}  # each length drawn, per question
    assert lengths == [len(r["doc_offsets"]) for r in world_splits(60, 10, seed=0, train_docs=[8, 32, 64])["train"]]
    assert {len(r["doc_offsets"]) for r in plain["train"]} == {7}
    build_world_dataset(tmp_path / "w", n_train=4, n_heldout=2, seed=0, train_docs=[16])
    assert json.loads((tmp_path / "w" / "world.json").read_text())["train_docs"] == [16]
    for bad in ([], [0], ["8"]):
        with pytest.raises(ValueError, match="train_docs"):
            build_world_dataset(tmp_path / "bad", n_train=4, n_heldout=2, train_docs=bad)


def test_dataset_folder_loads(tmp_path):
    from coordrl.data.show import load_built

    paths = build_world_dataset(tmp_path / "w", n_train=20, n_heldout=6, seed=0)
    ds = load_built(paths["train"])
    assert len(ds) == 20 and {"id", "question", "answers", "context", "doc_offsets", "gold_documents", "type"} <= set(
        ds.column_names
    )


def test_tokenizer_names_single_token_roundtrip_and_trl_template(tok):
    from trl.chat_template_utils import qwen3_chat_template

    assert tok.chat_template == qwen3_chat_template
    for n in make_world(0).names:
        assert len(tok(f" {n}", add_special_tokens=False)["input_ids"]) == 1
    for d in DECADES:  # one token per decade: comparing birth decades is comparing two tokens
        assert len(tok(f" {d}s", add_special_tokens=False)["input_ids"]) == 1
    for text in [
        '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["In which decade was Bofa born?"]}}\n</tool_call>',
        "dummy",
        "{}}",
        "<answer> 1930s</answer>",
    ]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


@pytest.mark.parametrize("good,reward", [(True, 1.0), (False, 0.0)])
def test_scripted_demonstrations_score_and_mask(tok, good, reward):
    from coordrl.envs.chat import ChatCodec
    from coordrl.envs.step import StepEnv

    codec, factory = ChatCodec(tok), make_env_factory(tok)
    for row in world_splits(0, 6, seed=0)["heldout"]:
        env = StepEnv(factory(), codec, max_turns=3)
        env.reset(**with_world_prompt(row))
        for turn in scripted_turns(row, good):
            step = env.step(turn)
        assert step.terminated and step.reward == reward
        # Every lookup of a scripted trajectory finds its fact (and only facts about the named entity).
        findings = env.env.findings
        assert findings and all(
            any(w in f["text"] for w in json.loads(row["chain"]).values() if isinstance(w, str))
            or f["query"].split()[-2] in f["text"]
            for f in findings
        )
        if good:
            assert any(row["answers"][0] in f["text"] for f in findings) or row["type"] == "comparison"
        ids, mask = demo_ids(row, good, codec, factory)
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        hidden = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert "<tool_response>" not in trained and "finding(s)" in hidden and "<answer>" in trained
        assert ids == env.prompt_ids + env.completion_ids


def test_world_config_trains_with_the_world_prompt_and_records_it(tmp_path):
    from pathlib import Path

    from coordrl.data.world import WORLD_SYSTEM_PROMPT
    from coordrl.train.config import load_config
    from coordrl.train.run import _dataset, checkpoint_metadata

    cfg = load_config(
        Path(__file__).parents[1] / "configs" / "world_cpu.yaml", {"world_train_size": "8", "world_heldout_size": "4"}
    )
    assert cfg.coord.system_prompt == WORLD_SYSTEM_PROMPT
    ds = _dataset("world", cfg.coord, tmp_path, "train")
    # The rows coordrl train hands TRL carry exactly the prompt the warm start and evaluate_world use.
    row = ds[0]
    assert row["prompt"] == with_world_prompt(row)["prompt"] and row["prompt"][0]["content"] == WORLD_SYSTEM_PROMPT
    assert checkpoint_metadata(cfg, str(tmp_path))["system_prompt"] == WORLD_SYSTEM_PROMPT
    default = load_config(Path(__file__).parents[1] / "configs" / "tiny_cpu.yaml", {})
    assert (
        "query_agents" in checkpoint_metadata(default, str(tmp_path))["system_prompt"]
        and default.coord.system_prompt is None
    )


def test_kept_warm_start_matches_the_world_tokenizer_and_prompt(tok):
    from pathlib import Path

    from transformers import AutoTokenizer

    from coordrl.data.world import WORLD_SYSTEM_PROMPT
    from coordrl.rollout.models import WORLD_MODEL, resolve_model
    from coordrl.rollout.world import with_world_prompt

    kept = resolve_model(WORLD_MODEL)
    kept_tok = AutoTokenizer.from_pretrained(kept)
    row = world_splits(0, 2, seed=0)["heldout"][1]
    text = row["context"] + row["question"] + "".join(scripted_turns(row, True))
    assert kept_tok(text)["input_ids"] == tok(text)["input_ids"] and kept_tok.chat_template == tok.chat_template
    assert with_world_prompt(row)["prompt"][0]["content"] == WORLD_SYSTEM_PROMPT
    meta = json.loads((Path(kept) / "coordrl_warm_start.json").read_text())
    # The kept checkpoint is what scripts/build_warm_start.py builds with its defaults.
    builder = _warm_start_builder()
    assert meta["steps"] == 400 and meta["p_good"] == builder.DEFAULT_P_GOOD == {"bridge": 0.45, "comparison": 0.35}
    built_with = defaults(builder.build)
    for key in (
        "seed",
        "lr",
        "batch",
        "drills",
        "drill_weight",
        "max_drill",
        "warmup",
        "name_weight",
        "recall_frac",
        "compare_frac",
        "adjacent_frac",
        "adjacent_from",
        "n_train",
    ):
        assert meta[key] == built_with[key], key
    assert meta["episode_frac"] == built_with["episode_frac"] == 0.5


def _warm_start_builder():
    return load_script("scripts/build_warm_start.py")


def test_warm_start_build_is_a_function_of_its_seed(tmp_path):
    # Fixed work on fixed threads: the same seed gives byte-identical weights, whatever the machine's speed.
    build = _warm_start_builder().build
    # From step 2 on, comparison drills also come in the episode layout, in their own padded group.
    small = {"steps": 3, "n_train": 12, "n_eval": 4, "batch": 4, "drills": 8, "threads": 2}
    small |= {"compare_frac": 1.0, "adjacent_from": 2, "episode_frac": 0.5}
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    weights = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        meta = build(tmp_path / name, seed=seed, **small)
        assert meta["steps"] == 3 and meta["torch_threads"] == 2
        weights.append((tmp_path / name / "model.safetensors").read_bytes())
        # The build's deterministic kernels do not leak into what runs next in the process.
        assert torch.are_deterministic_algorithms_enabled() == before
    assert weights[0] == weights[1] and weights[0] != weights[2]


def test_routed_warm_start_is_taught_in_the_routed_environment(tmp_path, tok):
    # A routed policy's prompt carries the routed tool description: the warm start it starts from must
    # have been taught with that prompt, not the broadcast one.
    from coordrl.envs.chat import ChatCodec

    builder = _warm_start_builder()
    env = builder.env_settings({"activation": "routed", "route_bm25_top_k": "1", "route_summary_top_k": "1"})
    assert env == {"activation": "routed", "route_bm25_top_k": 1, "route_summary_top_k": 1}
    with pytest.raises(SystemExit, match="max_steps"):
        builder.env_settings({"max_steps": "3"})
    # The learning check evaluates in the same typed environment, its training-only overrides left out.
    check = load_script("benchmarks/learning_check.py")
    assert check.env_overrides({"activation": "routed", "route_bm25_top_k": "2", "max_steps": "5"}) == {
        "activation": "routed",
        "route_bm25_top_k": 2,
    }
    row = world_splits(0, 2, seed=0)["heldout"][0]
    routed, _ = demo_ids(row, True, ChatCodec(tok), make_env_factory(tok, **env))
    broadcast, _ = demo_ids(row, True, ChatCodec(tok), make_env_factory(tok))
    assert "only to the readers of the chunks that best match" in tok.decode(routed)
    assert "only to the readers" not in tok.decode(broadcast)
    small = {"steps": 1, "n_train": 4, "n_eval": 2, "batch": 2, "drills": 2, "threads": 1}
    meta = builder.build(tmp_path / "routed", env=env, **small)
    assert meta["env"] == env and "env" not in builder.build(tmp_path / "plain", **small)


def test_warm_start_for_served_readers_is_taught_on_their_chunking(tmp_path):
    # Served readers read one world document per chunk; a warm start the learning check rebuilds for
    # them is taught on that chunking, and records it (a default build's record does not change).
    check = load_script("benchmarks/learning_check.py")
    served = check.served_overrides({}, {"readers": "http://127.0.0.1:1", "reader_model": "m"})
    assert check.warm_start_settings(check.setup_for("parser", "vllm"), None, served) == {"docs_per_chunk": 1}
    # The check passes the served environment on; how readers are served stays out of the build, whose
    # demonstrations are played with lexical readers (over HTTP they would be slower and server-dependent).
    env = check.env_overrides(served)
    assert env["readers"] == "http://127.0.0.1:1"
    assert check.warm_start_settings(check.setup_for("parser", "vllm"), env, served) == {"docs_per_chunk": 1}
    routed = {**env, "activation": "routed"}
    assert check.warm_start_settings(check.setup_for("parser", "vllm"), routed, served) == {
        "env": {"activation": "routed"},
        "docs_per_chunk": 1,
    }
    assert check.warm_start_settings(check.setup_for("parser"), {"activation": "routed"}, {}) == {
        "env": {"activation": "routed"}
    }
    assert check.warm_start_settings(check.setup_for("hmars"), None, {"world_docs_per_chunk": "1"}) == {}
    small = {"steps": 1, "n_train": 4, "n_eval": 2, "batch": 2, "drills": 2, "threads": 1}
    assert _warm_start_builder().build(tmp_path / "one", docs_per_chunk=1, **small)["docs_per_chunk"] == 1
    with pytest.raises(SystemExit):
        _warm_start_builder().main(["--docs-per-chunk", "0", "--out", str(tmp_path / "never")])


def test_kept_one_document_warm_start_is_the_builders_defaults_on_one_document_chunks(tok):
    # `--readers vllm --reuse-warm-start` starts from it, and `coordrl:world-warm-start-1doc` names it.
    from pathlib import Path

    from transformers import AutoTokenizer

    from coordrl.rollout.models import WORLD_MODEL, WORLD_ONE_DOC_MODEL, resolve_model

    check = load_script("benchmarks/learning_check.py")
    kept = Path(resolve_model(WORLD_ONE_DOC_MODEL))
    assert check.setup_for("parser", "vllm").kept == kept == check.KEPT_ONE_DOC
    assert check.setup_for("parser").kept == Path(resolve_model(WORLD_MODEL)) != kept
    meta = json.loads((kept / "coordrl_warm_start.json").read_text())
    plain = json.loads((Path(resolve_model(WORLD_MODEL)) / "coordrl_warm_start.json").read_text())
    assert meta["docs_per_chunk"] == 1 and "docs_per_chunk" not in plain and "env" not in meta
    # Every other setting is the default build's (the kept plain warm start's, checked against the builder above).
    for key in ("seed", "steps", "p_good", "lr", "batch", "drills", "name_weight", "episode_frac", "n_train"):
        assert meta[key] == plain[key], key
    row = world_splits(0, 1, seed=0, docs_per_chunk=1)["heldout"][0]
    text = row["context"] + row["question"]
    assert AutoTokenizer.from_pretrained(str(kept))(text)["input_ids"] == tok(text)["input_ids"]


def test_learning_check_sampled_figures_average_rounds_and_name_them_in_the_run():
    import argparse

    check = load_script("benchmarks/learning_check.py")
    # Through served readers 4 sampled episodes per question unless --eval-samples says otherwise.
    assert check.default_eval_samples(None, "vllm") == 4 and check.default_eval_samples(2, "vllm") == 2
    assert check.default_eval_samples(None, "lexical") == 1 and check.default_eval_samples(None, "vllm", "hmars") == 1
    # Round 0 is the one-sample evaluation's own draw; no two seeds' rounds share a sampling seed.
    assert check.round_seed(2, 0) == 2
    assert len({check.round_seed(s, i) for s in range(3) for i in range(4)}) == 12
    a, b = {"bridge": 0.9, "all": 0.8}, {"bridge": 0.8, "all": 0.7}
    assert check.mean_rounds([a]) is a
    assert check.mean_rounds([a, b]) == pytest.approx({"bridge": 0.85, "all": 0.75})
    args = argparse.Namespace(protocol="parser", readers="vllm", steps=130, minutes=None, eval_n=200, eval_samples=1)
    # One sample leaves the identity as records made before the flag hold it; more are part of the run.
    assert "eval_samples" not in check.run_identity(args, {}, "w" * 64)
    args.eval_samples = 4
    assert check.run_identity(args, {}, "w" * 64)["eval_samples"] == 4
    with pytest.raises(SystemExit):
        check.main(["--eval-samples", "0", "--out", "/nonexistent/never"])


@pytest.mark.parametrize("docs_per_chunk", [2, 1])
def test_episode_layout_drill_reads_as_the_environment_renders_findings(tok, docs_per_chunk):
    # The drill teaches the comparison in the layout the policy meets: the question, then the findings
    # exactly as the environment renders them (chunk numbers aside), then the answer tag; with one
    # document per chunk (model-served readers) the reader count is that chunking's.
    import random
    import re

    from coordrl.data.world import decade_sentence
    from coordrl.envs.chat import ChatCodec
    from coordrl.rollout.world import demo_ids, make_env_factory

    layout = _warm_start_builder().episode_layout
    rows = world_splits(0, 8, seed=0, docs_per_chunk=docs_per_chunk)["heldout"]
    row = next(r for r in rows if r["type"] == "comparison")
    chain = json.loads(row["chain"])
    (p1, p2), (y1, y2) = chain["people"], chain["decades"]
    ids, _ = demo_ids(row, True, ChatCodec(tok), make_env_factory(tok))
    rendered = re.sub(r"chunk \d+", "chunk N", tok.decode(ids))
    readers = len(row["chunks"])
    assert readers == {2: 4, 1: 7}[docs_per_chunk]
    for seed in range(4):  # both orders of the findings
        facts = [decade_sentence(p1, y1), decade_sentence(p2, y2)]
        text = layout(p1, p2, facts, random.Random(seed), *([readers] if docs_per_chunk != 2 else []))
        lines = re.sub(r"chunk \d+", "chunk N", text).split("\n")
        assert lines[0] in rendered and lines[1] in rendered and lines[-1] == "<answer>"
        block = "\n".join(lines[1:-1])
        names_in_order = re.findall(r'was (\w+) born\?"', block)
        if names_in_order == [p1, p2]:
            assert block in rendered
        else:
            assert names_in_order == [p2, p1]
            for line in lines[2:-1]:
                assert line.split(": ", 1)[1] in rendered


def test_length_sweep_pads_the_same_questions_with_unrelated_documents():
    from coordrl.data.world import filler_world, make_world, world_rows

    world = make_world(0)
    base = world_splits(0, 6, seed=0)["heldout"]
    assert not set(filler_world().people + filler_world().films + filler_world().orgs) & set(world.names)
    for n_docs in (8, 100):
        rows, _ = world_rows(6, 0, world, prefix="heldout", n_docs=n_docs)
        for row, short in zip(rows, base, strict=True):
            assert (row["question"], row["answers"], row["chain"]) == (
                short["question"],
                short["answers"],
                short["chain"],
            )
            assert len(row["doc_offsets"]) == n_docs and len(row["chunks"]) == n_docs // 2
            # The question's own documents are all there, at the gold positions the row names.
            docs = row["context"].split("\n\nDocument ")
            short_docs = {d.split("\n", 1)[1] for d in short["context"].split("\n\nDocument ")}
            assert short_docs <= {d.split("\n", 1)[1] for d in docs}
            assert all(short["context"].count(docs[g - 1].split("\n", 1)[1]) == 1 for g in row["gold_documents"])


def test_learning_check_target_counts_a_collapse_after_step_50():
    check = load_script("benchmarks/learning_check.py")
    # Served readers are checked against their own bar; the lexical check's stays as it was.
    assert (check.setup_for("parser").target_sampled, check.setup_for("parser").grpo_s_target) == (0.92, 300)
    served = check.setup_for("parser", "vllm")
    assert (served.target_sampled, served.target_greedy, served.grpo_s_target) == (0.90, 0.95, 600)
    assert served.reward_floor == check.REWARD_FLOOR
    # The served readers' recipe applies unless the user sets it; the server's URL always wins.
    server = {"readers": "http://127.0.0.1:1", "reader_model": "m"}
    recipe = {
        "world_docs_per_chunk": "1",
        "beta": "0.1",
        "share_prompt_prefix": "true",
        "share_generation_prefix": "true",
    }
    assert check.served_overrides({}, server) == {**recipe, **server}
    assert check.served_overrides({"world_docs_per_chunk": "2", "readers": "x"}, server)["world_docs_per_chunk"] == "2"
    assert check.served_overrides({"readers": "x"}, server)["readers"] == server["readers"]
    # 130 steps through served readers unless --steps says otherwise; the lexical check keeps the config's.
    assert check.default_steps(None, "vllm") == 130
    assert check.default_steps(100, "vllm") == 100
    assert check.default_steps(None, "lexical") is None
    # One point every other optimizer step (num_iterations: 2), as the check logs them.
    steady = [{"step": s, "reward": 0.8} for s in range(2, 151, 2)]
    assert check.lowest_window_mean(steady) == pytest.approx(0.8)
    # A dip to 0.2 over steps 61-70: the window ending at step 70 averages 0.2 (and windows ending
    # before step 50 do not count, so an early low start is allowed).
    dip = [{"step": p["step"], "reward": 0.2 if 60 < p["step"] <= 70 or p["step"] < 20 else 0.8} for p in steady]
    assert check.lowest_window_mean(dip) == pytest.approx(0.2)
    early = [{"step": p["step"], "reward": 0.1 if p["step"] <= 40 else 0.8} for p in steady]
    assert check.lowest_window_mean(early) == pytest.approx(0.8)
    assert check.lowest_window_mean(steady[:20]) is None  # never reached step 50
    parser = check.SETUPS["parser"]
    assert (parser.target_sampled, parser.target_greedy, parser.reward_floor) == (0.92, 0.96, 0.5)


def test_learning_check_saves_each_seed_and_resumes_only_the_same_run(tmp_path, capsys):
    # A check stopped midway keeps its finished seeds; --resume reuses them only for the same settings.
    import torch

    check = load_script("benchmarks/learning_check.py")
    out = tmp_path / "check"
    base = ["--reuse-warm-start", "--seeds", "0", "--eval-n", "2", "--threads", "1", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert check.main([*base, "--steps", "1"]) == 0
        record = json.loads((out / "learning_check.json").read_text())
        assert record["complete"] and list(record["seeds"]) == ["0"] and record["run"]["steps"] == 1
        final = out / "seed0" / "final" / "model.safetensors"
        trained_at = final.stat().st_mtime_ns
        with pytest.raises(SystemExit, match="steps: 1 there, 2 now"):
            check.main([*base, "--steps", "2", "--resume"])
        capsys.readouterr()
        assert check.main([*base, "--steps", "1", "--resume"]) == 0
        printed = capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert "seed 0: kept from" in printed and "gain:" in printed
    assert final.stat().st_mtime_ns == trained_at  # not trained again
    again = json.loads((out / "learning_check.json").read_text())
    assert again["seeds"] == record["seeds"] and again["resumed_seeds"] == [0] and again["complete"]


def test_learning_check_resume_refuses_seeds_read_by_another_reader_model(tmp_path):
    # Served-reader seeds depend on the reader's weights: a rebuilt world reader gives other findings.
    import argparse

    check = load_script("benchmarks/learning_check.py")
    a = argparse.Namespace(protocol="parser", readers="vllm", steps=130, minutes=None, eval_n=200)
    (tmp_path / "model.safetensors").write_bytes(b"reader weights")
    sha = check.weights_sha256(tmp_path)
    assert sha == hashlib.sha256(b"reader weights").hexdigest() and check.weights_sha256(tmp_path / "none") is None
    earlier = check.run_identity(a, {"readers": "http://127.0.0.1:1"}, "w" * 64, sha)
    assert "readers" not in earlier["overrides"] and earlier["reader_sha256"] == sha
    # The served model's folder is held relative to the repository (a clone elsewhere is the same run);
    # a folder outside it stays as given.
    served = {"readers": "http://127.0.0.1:1", "reader_model": str(check.READER_MODEL)}
    assert (
        check.run_identity(a, served, "w" * 64, sha)["overrides"]["reader_model"]
        == "src/coordrl/resources/world_reader"
    )
    outside = {"reader_model": str(tmp_path)}
    assert check.run_identity(a, outside, "w" * 64, sha)["overrides"]["reader_model"] == str(tmp_path)
    record = tmp_path / "learning_check.json"
    record.write_text(json.dumps({"run": earlier, "seeds": {"2": {"steps": 130}}}))
    assert list(check.finished_seeds(record, check.run_identity(a, {"readers": "http://127.0.0.1:2"}, "w" * 64, sha)))
    with pytest.raises(SystemExit, match="reader_sha256"):
        check.finished_seeds(record, check.run_identity(a, {}, "w" * 64, "r" * 64))
