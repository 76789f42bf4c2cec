"""``protocol: hmars`` through coordrl eval / export / answer and `Coordinator`, end to end on CPU.

A tiny mid-agent policy is trained for one GRPO step with scripted generation (module fixture), then
evaluated on a tiny sweep, exported, and asked questions. The tiny model has random weights, so its
broadcasts are noise: the model-driven tests check plumbing, files and the HMARS evidence columns;
a scripted broadcast (parsed by TRL through the same `StepEnv`) checks K > 1 regions and evidence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordrl.cli import main
from coordrl.data.build import SweepConfig, build_sweep
from coordrl.data.show import load_built
from coordrl.inference.coordinator import Coordinator
from coordrl.inference.export import POLICY_META, resolve_policy
from coordrl.testing import scripted_trainer_class
from coordrl.train.config import load_config
from coordrl.train.run import CHECKPOINT_META, COMPLETE_MARKER, build_trainer
from coordrl.train.trainer import CoordGRPOTrainer

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
EVAL_FLAGS = ["--max-new-tokens", "16", "--limit", "1", "--no-progress"]
HMARS_COLUMNS = {"recall", "pages_selected", "answer_prompt_tokens", "model_calls", "regions", "evidence_tokens"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hmars-train") / "run"
    c = load_config(ROOT / "configs" / "hmars_tiny_cpu.yaml", {"output_dir": str(out), "max_steps": "1", "save_steps": "1", "sample_num_paragraphs": "30"})
    call = {"name": "broadcast", "arguments": {"interpretation": "Find the nationality of both people.", "hints": {"s0": "nationality"}}}
    build_trainer(c, trainer_cls=scripted_trainer_class(CoordGRPOTrainer, rounds=1, call=call)).train()
    ckpt = out / "checkpoint-1"
    assert (ckpt / COMPLETE_MARKER).exists()
    return ckpt


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hmars-data") / "sweep"
    build_sweep(SweepConfig(questions=2, lengths=[20, 40]), out)
    return out


@pytest.fixture(scope="module")
def export_dir(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hmars-export") / "hmars-tiny"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def row(sweep) -> dict:
    return dict(load_built(sweep / "length-00040")[0])


class ScriptedBroadcast:
    """Text policy: one broadcast naming the question, with a hint for every sub-agent it is shown."""

    def act(self, env) -> str:
        memory = env.messages[1]["content"]
        subs = sorted({w.strip(",.:;()[]") for w in memory.split() if w.strip(",.:;()[]")[:1] == "s" and w.strip(",.:;()[]")[1:].isdigit()})
        question = memory.split("\n", 1)[0].removeprefix("Question: ")
        call = {"name": "broadcast", "arguments": {"interpretation": question, "hints": {s: question for s in subs}}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_eval_reports_hmars_evidence_metrics(checkpoint, sweep, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "--policy", str(checkpoint), "--data", str(sweep), "--out", str(out), *EVAL_FLAGS]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"] == "hmars" and results["env"]["c_sub"] == 2048 and results["settings"]["max_turns"] == 1
    for s in results["subsets"]:
        assert HMARS_COLUMNS <= set(s["metrics"]) and s["metrics"]["samples"] == 1 and s["metrics"]["failed"] == 0
        assert s["metrics"]["model_calls"] >= 1 and s["metrics"]["regions"] == 1  # answer model at least; one mid-agent
    assert HMARS_COLUMNS <= set(results["overall"]) and "reader_calls" in results["overall"]
    trace = json.loads((out / "traces" / "length-00020.jsonl").read_text().splitlines()[0])
    assert trace["status"] == "ok" and trace["messages"][0]["role"] == "system" and trace["messages"][1]["content"].startswith("Question: ")
    assert "Regional memory" in trace["messages"][1]["content"] or len(trace["messages"][1]["content"]) > 200
    assert {"regions", "evidence", "scores", "lead_prompt_tokens"} <= set(trace) and trace["info"]["answer_calls"] == 1
    md = (out / "results.md").read_text()
    assert "evidence recall" in md and "pages selected" in md and "answer prompt tokens" in md and "model calls" in md
    assert "queries/turn" not in md  # PARSER's reader columns stay PARSER's
    # Region settings from the checkpoint, overridable; the rerun with other settings is refused.
    assert main(["eval", "--policy", str(checkpoint), "--data", str(sweep), "--out", str(out), *EVAL_FLAGS, "--hmars", "c_sub=1024"]) == 2


def test_export_records_the_hmars_protocol(export_dir, checkpoint):
    meta = json.loads((export_dir / POLICY_META).read_text())
    assert meta["protocol"] == "hmars" and [t["function"]["name"] for t in meta["tools"]] == ["broadcast"]
    assert set(meta["tools"][0]["function"]["parameters"]["properties"]) == {"interpretation", "hints"}
    assert "broadcast" in meta["system_prompt"] and meta["env"]["c_sub"] == 2048 and meta["env"]["tokenizer"] is None
    assert meta["hmars"]["page_tokens"] == 512 and meta["turn_caps"]["train_max_turns"] == 1
    card = (export_dir / "README.md").read_text()
    assert "HMARS mid-agent" in card and "broadcast(interpretation" in card
    source = resolve_policy(export_dir)
    assert source.kind == "export" and source.protocol == "hmars" and source.prompt("Q?")[0]["content"] == meta["system_prompt"]
    assert json.loads((checkpoint / CHECKPOINT_META).read_text())["system_prompt"] == meta["system_prompt"]


def test_coordinator_runs_every_region_with_the_policy(export_dir, checkpoint, row):
    exported = Coordinator.from_pretrained(export_dir, hmars={"group_size": 2}, max_new_tokens=16)
    ckpt = Coordinator.from_pretrained(checkpoint, hmars={"group_size": 2}, max_new_tokens=16)
    try:
        a = exported.answer(row["context"], row["question"])
        b = ckpt.answer(row["context"], row["question"])
    finally:
        exported.close()
        ckpt.close()
    assert a.info["regions"] > 1 and len(a.trace) == a.info["regions"]
    assert all(t["messages"][0]["role"] == "system" and t["messages"][2]["role"] == "assistant" for t in a.trace)
    assert a.info["answer_calls"] == 1 and "em" not in a.info and a.info["document_tokens"] > 4000
    assert a.trace == b.trace and a.answer == b.answer  # greedy from the same ids: the export behaves like the checkpoint


def test_coordinator_merges_evidence_of_all_regions(export_dir, row):
    base = Coordinator.from_pretrained(export_dir, hmars={"group_size": 2}, max_new_tokens=16)
    base.close()
    coord = Coordinator(ScriptedBroadcast(), base.tokenizer, base.source, base.config, max_turns=1)
    try:
        result = coord.answer(row["context"], row["question"])
    finally:
        coord.close()
    k = result.info["regions"]
    assert k > 1 and [t["region"] for t in result.trace] == list(range(k)) and not any(t["error"] for t in result.trace)
    assert result.info["broadcasts"] == k and result.info["tool_errors"] == 0
    # TRL parsed each region's tool call; each region's sub-agents selected only their own pages.
    assert all(t["messages"][2]["tool_calls"][0]["function"]["name"] == "broadcast" for t in result.trace)
    pages = [e["page"] for e in result.evidence]
    assert pages == sorted(pages) and pages == sorted({p for t in result.trace for p in t["pages"]})
    assert pages and result.answer and all(e["page"] in result.trace[e["region"]]["pages"] for e in result.evidence)
    assert result.info["selector_calls"] == result.info["subagents"] > result.info["participants"] / k  # every region fanned out
    assert result.info["pages_selected"] == len(pages) and result.info["model_calls"] == result.info["selector_calls"] + 1


def test_region_prompts_are_the_training_prompts(export_dir, row):
    from coordrl.envs.chat import ChatCodec
    from coordrl.envs.hmars import HmarsEnvFactory, _RegionMidAgent
    from coordrl.envs.hmars_prompts import hmars_prompt
    from coordrl.envs.step import StepEnv

    source = resolve_policy(export_dir)
    cfg = source.env_config()
    f = HmarsEnvFactory(cfg)
    codec = ChatCodec(f.tokenizer)
    train = StepEnv(f(), codec, max_turns=1, prompt_fn=lambda r: hmars_prompt(r["question"]))
    region = StepEnv(_RegionMidAgent(cfg, f.backends, f.tokenizer, f.index_cache, 0), codec, max_turns=1, prompt_fn=lambda r: hmars_prompt(r["question"]))
    train.reset(**row)
    region.reset(**row)
    assert region.prompt_ids == train.prompt_ids  # same tool schema, same memory: the tokens training saw


def test_answer_cli_takes_hmars_overrides(export_dir, row, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(row["context"], encoding="utf-8")
    args = ["answer", "--policy", str(export_dir), "--document", str(doc), "--question", row["question"], "--max-new-tokens", "8"]
    capsys.readouterr()
    assert main([*args, "--hmars", "group_size=2", "--json"]) in (0, 1)  # 1: the random policy's regions may find nothing
    out = json.loads(capsys.readouterr().out)
    assert out["info"]["regions"] > 1 and {"answer", "trace", "evidence", "info"} <= set(out)
    assert main([*args, "--hmars", "no_such_setting=1"]) == 2
    assert "unknown HMARS setting" in capsys.readouterr().err
    assert main([*args, "--readers", "http://127.0.0.1:9"]) == 2  # PARSER readers do not apply to a mid-agent
