"""CPU end-to-end GRPO training through TRL with the tiny local model and lexical readers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordrl.cli import main
from coordrl.rollout.models import (
    CHECKPOINT_META,
    COMPLETE_MARKER,
    latest_complete_checkpoint,
)
from coordrl.testing import LatencyInjectingFleet, scripted_trainer_class
from coordrl.train.config import ConfigError, load_config
from coordrl.train.run import build_trainer
from coordrl.train.trainer import CoordGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def cfg(tmp_path, **over):
    base = {
        "output_dir": str(tmp_path / "run"),
        "max_steps": 2,
        "eval_strategy": "no",
        "eval_data": "null",
        "report_to": "none",
        "save_steps": 2,
    }
    base.update({k: str(v) for k, v in over.items()})
    return load_config(TINY, base)


def test_config_rejects_unknown_keys_and_types(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        load_config(TINY, {"max_step": "2"})
    with pytest.raises(ConfigError, match="num_generations"):
        load_config(TINY, {"num_generations": "four"})
    with pytest.raises(ConfigError, match="disagree"):
        load_config(TINY, {"max_tool_calling_iterations": "5"})
    c = load_config(TINY, {"max_steps": "2", "bf16": "false", "readers": "http://a:1,http://b:2", "reader_model": "m"})
    assert c.grpo["max_steps"] == 2 and c.grpo["bf16"] is False and c.coord.readers == "http://a:1,http://b:2"
    assert c.grpo["max_tool_calling_iterations"] == c.coord.max_turns == 3


def test_training_steps_checkpoint_mask_metrics_and_traces(tmp_path):
    c = cfg(tmp_path, report_to="wandb")
    captured = []

    class Capture(scripted_trainer_class(CoordGRPOTrainer, rounds=2)):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured.append(out)
            return out

    trainer = build_trainer(c, trainer_cls=Capture)
    # The EM reward scores rollouts cut off by a token cap as 0, like StepEnv in eval and inference.
    assert trainer.reward_funcs[0].eos_token_id == trainer.processing_class.eos_token_id
    trainer.train()
    out_dir = Path(c.grpo["output_dir"])
    ckpt = out_dir / "checkpoint-2"
    assert (ckpt / COMPLETE_MARKER).exists() and (ckpt / "model.safetensors").exists()
    meta = json.loads((ckpt / CHECKPOINT_META).read_text())
    assert meta["protocol"] == "parser" and meta["env"]["max_turns"] == 3 and "query_agents" in meta["system_prompt"]
    assert latest_complete_checkpoint(out_dir) == ckpt
    assert list((out_dir / "wandb").glob("offline-run-*")), "wandb offline logs missing"

    # The loss mask excludes exactly the tool-result tokens, on the tensors the trainer built.
    tok = trainer.processing_class
    out = captured[0]
    tool_mask, completion_mask, ids = out["tool_mask"], out["completion_mask"], out["completion_ids"]
    for row in range(ids.shape[0]):
        live = completion_mask[row].bool()
        masked = tok.decode(ids[row][live & (tool_mask[row] == 0)])
        trained = tok.decode(ids[row][live & (tool_mask[row] == 1)])
        assert masked.count("<tool_response>") == 2 and "finding(s) from" in masked
        assert "<tool_response>" not in trained and "finding(s)" not in trained
        assert trained.count("<tool_call>") == 2 and "<answer>unknown</answer>" in trained

    logs = [h for h in trainer.state.log_history if "env/turns" in h]
    assert logs and logs[0]["env/turns"] == 2 and logs[0]["env/reader_calls"] > 0
    assert logs[0]["tools/call_frequency"] == 2
    traces = [json.loads(line) for line in (out_dir / "traces" / "rank0.jsonl").read_text().splitlines()]
    assert len(traces) == 2 * 4 and all(t["info"]["turns"] == 2 for t in traces)
    assert traces[0]["completion"][0]["tool_calls"][0]["function"]["name"] == "query_agents"


def test_observation_tokens_enter_the_loss_only_in_the_ablation(tmp_path):
    captured = []

    class Capture(scripted_trainer_class(CoordGRPOTrainer, rounds=1)):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured.append(out)
            return out

    trainer = build_trainer(cfg(tmp_path, max_steps=1, mask_observations=False, traces=False), trainer_cls=Capture)
    assert trainer.mask_observations is False
    trainer.train()
    # Without tool_mask TRL's loss mask is the completion mask: tool-response tokens are trained on.
    assert captured and "tool_mask" not in captured[0]
    ids, live = captured[0]["completion_ids"], captured[0]["completion_mask"].bool()
    assert "finding(s) from" in trainer.processing_class.decode(ids[0][live[0]])


def test_tool_rounds_run_concurrently_across_rollouts(tmp_path):
    results = {}
    for concurrent in (True, False):
        fleet = LatencyInjectingFleet(0.05)
        c = cfg(tmp_path / str(concurrent), max_steps=1, tool_concurrency=concurrent, traces=True)
        trainer = build_trainer(c, trainer_cls=scripted_trainer_class(CoordGRPOTrainer, rounds=2), fleet=fleet)
        trainer.train()
        traces = (Path(c.grpo["output_dir"]) / "traces" / "rank0.jsonl").read_text().splitlines()
        results[concurrent] = (
            fleet.max_in_flight,
            fleet.batches,
            [json.loads(t)["completion"] for t in traces],
            trainer.tool_loop_stats,
        )
    on, off = results[True], results[False]
    assert on[0] == 4 and off[0] == 1  # 4 rollouts per step: all in flight together vs one at a time
    assert on[1] == off[1] == 2 * 4
    assert on[3]["batched_rounds"] == 2 and off[3]["batched_rounds"] == 0
    # Same conversations either way (latency aside): concurrency changes timing, never results.
    strip = lambda comps: [[{k: v for k, v in m.items()} for m in c] for c in comps]  # noqa: E731
    assert strip(on[2]) == strip(off[2])


def _run_cli(args, env, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "coordrl.cli", "train", "--config", str(TINY), *args], env=env, cwd=ROOT, **kw
    )


def test_resume_after_kill_keeps_the_data_order(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    common = [
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--eval_strategy",
        "no",
        "--eval_data",
        "null",
        "--report_to",
        "none",
    ]
    full = tmp_path / "full"
    assert _run_cli([*common, "--output_dir", str(full)], env).wait(timeout=300) == 0

    part = tmp_path / "part"
    proc = _run_cli([*common, "--output_dir", str(part)], env, start_new_session=True)
    deadline = time.time() + 300
    while not (part / "checkpoint-2" / COMPLETE_MARKER).exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (part / "final").exists()
    assert _run_cli([*common, "--output_dir", str(part), "--resume"], env).wait(timeout=300) == 0

    def ids_by_step(folder):
        by = {}
        for line in (folder / "traces" / "rank0.jsonl").read_text().splitlines():
            t = json.loads(line)
            by.setdefault(t["step"], []).append(t["id"])
        return by

    a, b = ids_by_step(full), ids_by_step(part)
    assert sorted(a) == [0, 1, 2, 3]
    # Steps 0-1 come from the killed run, 2-3 from the resumed one: the rows the killed run wrote
    # past checkpoint-2 (and a torn last line) were dropped on resume, so each step is there once.
    assert b == a
    assert (part / "final" / COMPLETE_MARKER).exists()


def test_rerun_without_resume_is_refused_and_overwrite_clears_the_old_run(tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        "--config",
        str(TINY),
        "--output_dir",
        str(run),
        "--max_steps",
        "1",
        "--eval_strategy",
        "no",
        "--eval_data",
        "null",
        "--report_to",
        "none",
    ]
    assert main([*args, "--save_steps", "1"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]

    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds another run (checkpoint-1, final, traces/)" in err and "--resume" in err and "--overwrite" in err
    assert main([*args, "--resume", "--overwrite"]) == 2
    assert "exclude each other" in capsys.readouterr().err

    # --overwrite deletes the old run before anything else (here the new run then stops at a config
    # mistake), so nothing of it is resumed later.
    assert main([*args, "--overwrite", "--per_device_train_batch_size", "3"]) == 2
    assert "divisible by num_generations" in capsys.readouterr().err
    assert not list(run.glob("checkpoint-*")) and not (run / "final").exists() and not (run / "traces").exists()
    assert (run / "data" / "train" / "state.json").exists()  # the built sample data is kept
    assert main([*args, "--resume"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_two_ranks_with_different_round_counts_stay_in_lockstep(tmp_path):
    script = ROOT / "tests" / "scripts" / "lockstep_run.py"
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # accelerate 1.15 runs `--cpu --num_processes 2` as ONE process unless an MPI hostfile is given;
    # its torchrun launcher with ACCELERATE_USE_CPU gives two real gloo ranks on one CPU host.
    env["ACCELERATE_USE_CPU"] = "true"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=400, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Rank 0's rollouts take 3 tool rounds, rank 1's take 1: rank 1 joins 2 extra rounds per step,
    # so both ranks make the same number of generation calls, each holding a collective.
    assert stats[0]["collectives"] == stats[1]["collectives"]
    assert stats[0]["stats"]["generation_rounds"] == 3 * 2 and stats[0]["stats"]["dummy_rounds"] == 0
    assert stats[1]["stats"]["generation_rounds"] == 1 * 2 and stats[1]["stats"]["dummy_rounds"] == 2 * 2


def test_hmars_protocol_trains_with_the_environment_reward(tmp_path):
    c = load_config(
        ROOT / "configs" / "hmars_tiny_cpu.yaml",
        {"output_dir": str(tmp_path / "hm"), "max_steps": "1", "save_steps": "1", "sample_num_paragraphs": "30"},
    )
    call = {
        "name": "broadcast",
        "arguments": {"interpretation": "Find the nationality of both people.", "hints": {"s1": "Scott Derrickson"}},
    }
    trainer = build_trainer(c, trainer_cls=scripted_trainer_class(CoordGRPOTrainer, rounds=1, call=call))
    trainer.train()
    log = next(h for h in trainer.state.log_history if "env/broadcasts" in h)
    assert log["env/broadcasts"] == 1 and log["env/selector_calls"] > 0 and log["env/answer_calls"] == 1
    assert "rewards/MidAgentEnv/mean" in log and log["tools/call_frequency"] == 1
    meta = json.loads((Path(c.grpo["output_dir"]) / "checkpoint-1" / CHECKPOINT_META).read_text())
    assert meta["protocol"] == "hmars" and meta["tools"] == ["broadcast"] and meta["env"]["c_sub"] == 2048


def test_trainer_survives_tool_call_json_nested_too_deep(tmp_path):
    from trl.chat_template_utils import parse_response

    trainer = build_trainer(cfg(tmp_path, max_steps=1, traces=False))
    tok = trainer._tokenizer
    deep = (
        '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ' + "[" * 3000 + "]" * 3000 + "}}\n</tool_call>"
    )
    ids = tok(deep, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with pytest.raises(RecursionError):  # what TRL's parser would meet without the guard
        type(tok).parse_response(tok, ids, prefix=[])
    parsed = parse_response(tok, ids, prefix=[])  # the call TRL's trainer makes for every generated turn
    assert "tool_calls" not in parsed and "[[[" in parsed["content"]  # TRL's fallback: the text, no call
    ok = tok(
        '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["Who?"]}}\n</tool_call>',
        add_special_tokens=False,
    )["input_ids"]
    assert parse_response(tok, ok + [tok.eos_token_id], prefix=[])["tool_calls"][0]["function"]["arguments"] == {
        "queries": ["Who?"]
    }


def test_train_closes_the_environment_factory_also_when_training_fails(tmp_path):
    from coordrl.train.run import train

    closed = []

    class FailingTrainer(CoordGRPOTrainer):
        def train(self, *args, **kwargs):
            # Record the close of the real factory (its reader fleet and caches), then fail mid-run.
            close = self.env_factory.close
            self.env_factory.close = lambda: (closed.append(type(self.env_factory).__name__), close())
            raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        train(cfg(tmp_path, max_steps=1, traces=False), trainer_cls=FailingTrainer)
    assert closed == ["ParserEnvFactory"]


def test_served_world_readers_warn_when_chunks_are_cut_otherwise_than_the_reader_reads(tmp_path, capsys):
    # The kept world reader reads one document per chunk; given the world's default two it misreads
    # most facts, so a run that serves it on two-document chunks is told which field to set.
    from coordrl.data.world_reader import built_docs_per_chunk, world_reader_dir
    from coordrl.train.config import CoordConfig
    from coordrl.train.run import _datasets

    reader = str(world_reader_dir())
    assert built_docs_per_chunk(reader) == 1 and built_docs_per_chunk(tmp_path) is None
    small = {"world_train_size": 8, "world_heldout_size": 2, "train_data": "world", "eval_data": "world"}
    served = {"readers": "http://127.0.0.1:9", "reader_model": reader, **small}
    _datasets(CoordConfig(**served), tmp_path)
    err = capsys.readouterr().err
    # Said once per run, though both splits are world splits.
    assert err.count(f"reader_model {reader} was built to read 1 world document(s) per chunk") == 1
    assert "world_docs_per_chunk is 2; set world_docs_per_chunk: 1" in err
    _datasets(CoordConfig(**served, world_docs_per_chunk=1), tmp_path)
    _datasets(CoordConfig(**{**served, "readers": "lexical"}), tmp_path)
    _datasets(CoordConfig(**{**served, "reader_model": "some/hub-model"}), tmp_path)
    assert "warning" not in capsys.readouterr().err


def test_data_a_run_built_with_other_settings_is_rebuilt_not_reused(tmp_path, capsys):
    # The run folder's data/ survives --overwrite; a rerun with another world size used to train on the
    # old build without a word.
    from coordrl.train.config import CoordConfig
    from coordrl.train.run import BUILD_STAMP, _dataset

    small = _dataset("world", CoordConfig(world_train_size=12, world_heldout_size=4), tmp_path, "train")
    assert len(small) == 12
    folder = tmp_path / "data" / "world-seed0"
    assert json.loads((folder / BUILD_STAMP).read_text()) == {
        "world_train_size": 12,
        "world_heldout_size": 4,
        "world_docs_per_chunk": 2,
    }
    capsys.readouterr()
    assert len(_dataset("world", CoordConfig(world_train_size=12, world_heldout_size=4), tmp_path, "train")) == 12
    assert capsys.readouterr().err == ""  # same settings: the build is reused quietly
    larger = _dataset("world", CoordConfig(world_train_size=20, world_heldout_size=4), tmp_path, "heldout")
    assert len(larger) == 4
    err = capsys.readouterr().err
    assert f"rebuilding {folder}" in err and "world_train_size: 12 -> 20" in err
    assert len(_dataset("world", CoordConfig(world_train_size=20, world_heldout_size=4), tmp_path, "train")) == 20
    one = _dataset(
        "world", CoordConfig(world_train_size=20, world_heldout_size=4, world_docs_per_chunk=1), tmp_path, "train"
    )
    assert "world_docs_per_chunk: 2 -> 1" in capsys.readouterr().err
    assert all(len(docs) == 1 for docs in one[0]["chunk_documents"])
    padded = _dataset(
        "world", CoordConfig(world_train_size=20, world_heldout_size=4, world_train_docs=[16]), tmp_path, "train"
    )
    assert "world_train_docs: None -> [16]" in capsys.readouterr().err
    assert all(len(row["doc_offsets"]) == 16 for row in padded)
