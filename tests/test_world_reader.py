"""The kept world reader model: its recipe and its answers in-process.

The model answers held-out world chunks (chains never seen in training) with the fact sentence in
the lexical reader's form, or exactly ``Unknown``. Its answers through vLLM's CPU build are tested in
test_world_reader_vllm.py, which serves it once for that test and the learning check.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from repo_scripts import load_script
from world_probe import kept_reader_heldout, probe_examples

from coordrl.data.world import make_world, q_city, world_splits
from coordrl.data.world_reader import (
    READER_UNKNOWN,
    _is_contrast,
    chunk_examples,
    eval_examples,
    sample_chunk,
    score_replies,
    world_reader_dir,
)
from coordrl.readers.base import ReaderRequest
from coordrl.readers.lexical import LexicalReader


@pytest.fixture(scope="module")
def builder():
    return load_script("scripts/build_world_reader.py")


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((world_reader_dir() / "coordrl_world_reader.json").read_text())


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    return kept_reader_heldout()


def test_targets_are_the_lexical_readers_answers(heldout):
    # A policy trained with lexical readers sees the same findings from the model reader.
    world, lexical = make_world(0), LexicalReader(threshold=0.9)
    row = heldout[0]
    n = 0
    for index, chunk in enumerate(row["chunks"]):
        by_kind = chunk_examples(row, index, world)
        for e in by_kind["positive"] + by_kind["hard"] + by_kind["row"]:
            assert lexical.answer_one(ReaderRequest(e.query, chunk, "k")) == e.answer
            n += 1
    assert n > 10


def test_hard_negative_names_the_entity_without_the_fact(heldout):
    chain = json.loads(heldout[0]["chain"])
    world = make_world(0)
    for index, chunk in enumerate(heldout[0]["chunks"]):
        if f"directed by {chain['director']}" in chunk and f"\n{chain['director']}\n" not in chunk:
            hard = chunk_examples(heldout[0], index, world)["hard"]
            assert any(e.query == q_city(chain["director"]) and e.answer == READER_UNKNOWN for e in hard)
            return
    pytest.skip("the first held-out row keeps the director's document with the film")


def test_contrast_sampling_and_figures(meta):
    import random

    world = make_world(0)
    train = world_splits(meta["recipe"]["n_train"], meta["recipe"]["n_heldout"], seed=0)["train"]
    mix = meta["recipe"]["negative_mix"]

    def share(p_contrast: float) -> float:
        rng = random.Random(0)
        groups = [sample_chunk(rng, train, world, 4, 0.5, mix, p_contrast) for _ in range(200)]
        return sum(_is_contrast(g[0].chunk) for g in groups) / len(groups)

    natural, all_contrast = share(0.0), share(1.0)
    assert 0.1 < natural < 0.4 and all_contrast == 1.0
    # Same-relation pairs are split out in the figures: one right, one wrong reply.
    chunk = "Document 1:\nAda\nAda was born in the city of Turin.\n\nDocument 2:\nBo\nBo was born in the city of Rome."
    row = {"chunks": [chunk]}
    positives = chunk_examples(row, 0, world)["positive"]
    assert [e.value for e in positives] == ["Turin", "Rome"]
    figures = score_replies(positives, [positives[0].answer, positives[0].answer])
    assert figures["positive_exact_contrast"] == 0.5 and figures["n_positive_contrast"] == 2
    assert "positive_exact_single" not in figures


def test_kept_model_matches_the_builders_recipe(builder, meta):
    folder = world_reader_dir()
    assert meta["recipe"] == json.loads(json.dumps(builder.DEFAULTS))
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size <= 15e6, f"kept world reader is {size / 1e6:.1f} MB"
    assert not list(folder.glob("*.bin")) and (folder / "model.safetensors").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["head_dim"] == 64  # vLLM's CPU attention rejects smaller heads
    # The builder's own held-out check (its first 20 questions) against the targets; all 200 are the
    # benchmark's (benchmarks/world_reader.py).
    assert meta["heldout"]["positive_exact"] >= 0.97 and meta["heldout"]["negative_answered"] <= 0.03


def test_kept_model_answers_heldout_prompts(builder, heldout):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = world_reader_dir()
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), use_safetensors=True, dtype=torch.float32, local_files_only=True
    )
    probe = probe_examples(heldout)
    replies = []
    for e in probe:  # plain generate on the full prompt, as a check on the builder's shared-prefix decoding
        ids = builder.prompt_ids(tok, e.chunk, e.query)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        replies.append(tok.decode(out[0, len(ids) :], skip_special_tokens=True).strip())
    assert builder.greedy_replies(model, tok, probe) == replies
    for e, reply in zip(probe, replies, strict=True):
        if e.kind == "positive":  # the right document's sentence (a copied value may still be wrong)
            assert reply.startswith(e.answer.split(" ", 1)[0]) and reply != READER_UNKNOWN, (e.query, reply)
        else:
            assert reply == READER_UNKNOWN, (e.query, reply)
    examples = eval_examples(heldout[:3], make_world(0))
    figures = score_replies(examples, builder.greedy_replies(model, tok, examples))
    assert figures["positive_exact"] >= 0.97 and figures["negative_answered"] == 0.0, figures


def test_builder_flags_become_the_recorded_recipe(builder, tmp_path):
    # A two-step build on two-document chunks: the flags reach the data, the held-out check and the record.
    out = tmp_path / "reader"
    flags = ["--steps", "2", "--warmup", "1", "--chunks", "2", "--queries", "2", "--n-eval-rows", "1"]
    # native: this process ran torch already, so only the level torch chose can be pinned (tests/test_software.py)
    flags += ["--cpu-capability", "native"]
    assert builder.main(["--out", str(out), *flags, "--docs-per-chunk", "2", "--p-contrast", "0.5"]) == 0
    meta = json.loads((out / builder.META_NAME).read_text())
    assert meta["software"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert meta["software"]["libraries"]["transformers"] == transformers.__version__
    assert meta["recipe"] == {
        **builder.DEFAULTS,
        "steps": 2,
        "warmup": 1,
        "chunks": 2,
        "queries": 2,
        "n_eval_rows": 1,
        "docs_per_chunk": 2,
        "p_contrast": 0.5,
    }
    two_doc = world_splits(meta["recipe"]["n_train"], meta["recipe"]["n_heldout"], seed=0, docs_per_chunk=2)
    asked = meta["heldout"]["n_positive"] + meta["heldout"]["n_negative"]
    assert asked == len(eval_examples(two_doc["heldout"][:1], make_world(0)))
    assert (out / "model.safetensors").is_file() and not (tmp_path / "reader.building").exists()


@pytest.mark.parametrize(
    "flag, value",
    [("--docs-per-chunk", "0"), ("--p-contrast", "1.5"), ("--warmup", "-1"), ("--n-eval-rows", "0")],
)
def test_builder_rejects_bad_flags_by_name(builder, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit):
        builder.main(["--out", str(tmp_path / "never"), flag, value])
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
