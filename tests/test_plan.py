"""`coordrl.train.plan`, the 8xH100 recipes, the accelerate configs and scripts/launch_grpo.sh (no GPU)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coordrl.train.config import load_config
from coordrl.train.plan import GIB, PlanError, format_plan, make_plan, model_shape

ROOT = Path(__file__).resolve().parents[1]
CFG_4B = ROOT / "configs" / "parser_qwen3_4b_8xh100.yaml"
CFG_8B = ROOT / "configs" / "parser_qwen3_8b_8xh100.yaml"
LAUNCH = ROOT / "scripts" / "launch_grpo.sh"


def plan_of(path: Path, overrides: dict[str, str] | None = None, **kw):
    return make_plan(load_config(path, overrides or {}), **kw)


@pytest.mark.parametrize("path", [CFG_4B, CFG_8B], ids=["4b", "8b"])
def test_recipes_plan_on_8x80gb(path):
    plan = plan_of(path, gpus_per_node=8, gpu_memory_gb=80)
    text = format_plan(plan)
    for section in ("[model]", "[layout]", "[batch]", "[token budget]", "[memory per training GPU]"):
        assert section in text
    assert text.splitlines()[-1].startswith("fits: yes (") and "GB of 80 GB per training GPU" in text
    lay, b, bud = plan.layout, plan.batch, plan.budget
    assert lay.reader_gpu_ids == [0, 1] and lay.training_gpu_ids == [2, 3, 4, 5, 6, 7] and lay.num_processes == 6
    assert lay.generation == "vllm-colocate" and lay.vllm_tp == 1 and lay.deepspeed_stage == 3
    assert b.num_generations == 5 and b.generation_batch_size % 5 == 0
    assert b.prompts_per_generation * 5 == b.generation_batch_size
    assert bud.max_turns == 9 and bud.max_completion_length >= bud.needed and bud.full_rounds == 9
    assert bud.per_turn_key == "max_tokens"  # vLLM's name for the per-turn cap
    assert plan.memory.total <= 80 * GIB and not plan.errors


def test_batch_arithmetic_matches_trl():
    """The plan's generation batch is what TRL's GRPOConfig computes for the same world size."""
    from trl import GRPOConfig

    plan = plan_of(CFG_4B)
    args = GRPOConfig(output_dir="/tmp/x", per_device_train_batch_size=2, gradient_accumulation_steps=10,
                      num_generations=5, use_cpu=True, bf16=False, report_to="none")  # fmt: skip
    # TRL uses world_size; on this machine it is 1, so scale by the plan's 6 processes.
    assert plan.batch.generation_batch_size == args.generation_batch_size * 6
    assert plan.batch.steps_per_generation == args.steps_per_generation


def test_indivisible_batch_is_refused():
    with pytest.raises(PlanError, match="divisible by num_generations"):
        plan_of(CFG_4B, {"num_generations": "7"})
    with pytest.raises(PlanError, match=">= 2"):
        plan_of(CFG_4B, {"num_generations": "1"})
    with pytest.raises(PlanError, match="both"):
        plan_of(CFG_4B, {"generation_batch_size": "120", "steps_per_generation": "10"})
    with pytest.raises(PlanError, match="eval batch"):
        plan_of(CFG_4B, {"per_device_eval_batch_size": "4"})


def test_small_gpu_is_refused_for_memory():
    with pytest.raises(PlanError, match="memory") as err:
        plan_of(CFG_4B, gpu_memory_gb=24)
    assert err.value.plan is not None and "fits: NO" in format_plan(err.value.plan)


def test_zero_stage_ordering_and_offload():
    totals = {s: plan_of(CFG_4B, {"deepspeed_stage": str(s)}, check=False).memory.total for s in (0, 2, 3)}
    assert totals[3] < totals[2] < totals[0]
    offloaded = plan_of(CFG_4B, {"deepspeed_offload": "true"})
    assert offloaded.memory.total < totals[3] and offloaded.memory.cpu_offload_per_process > 0
    with pytest.raises(PlanError, match="deepspeed_offload needs"):
        plan_of(CFG_4B, {"deepspeed_stage": "0", "deepspeed_offload": "true"})


def test_more_processes_less_memory_under_zero3():
    six = plan_of(CFG_8B).memory.total
    twelve = plan_of(CFG_8B, num_nodes=2).memory.total
    assert twelve < six
    assert plan_of(CFG_8B, num_nodes=2).layout.num_processes == 12


def test_completion_budget_too_small_is_refused_or_warned():
    with pytest.raises(PlanError, match="max_completion_length"):
        plan_of(CFG_4B, {"max_completion_length": "8192"})
    plan = plan_of(CFG_4B, {"max_completion_length": "8192", "allow_truncated_rollouts": "true"})
    assert any("max_completion_length" in w for w in plan.warnings) and plan.budget.full_rounds < 9
    with pytest.raises(PlanError, match="per-turn cap"):
        plan_of(CFG_4B, {"generation_kwargs": "{}"})
    with pytest.raises(PlanError, match="vllm_max_model_length"):
        plan_of(CFG_4B, {"vllm_max_model_length": "16384"})


def test_wrong_per_turn_key_for_the_backend():
    with pytest.raises(PlanError, match="max_new_tokens does not apply"):
        plan_of(CFG_4B, {"generation_kwargs": "{max_new_tokens: 1024}"})
    with pytest.raises(PlanError, match="max_tokens does not apply"):
        plan_of(CFG_4B, {"use_vllm": "false", "deepspeed_stage": "2"}, check=True)


def test_layout_errors():
    with pytest.raises(PlanError, match="no training GPUs left"):
        plan_of(CFG_4B, {"reader_gpus": "8"})
    with pytest.raises(PlanError, match="model size unknown"):
        plan_of(CFG_4B, {"model_params": "null"})
    with pytest.raises(PlanError, match="tensor_parallel_size"):
        plan_of(CFG_4B, {"vllm_tensor_parallel_size": "4"})
    with pytest.raises(PlanError, match="policy_server_gpus"):
        plan_of(CFG_4B, {"vllm_mode": "server"})
    plan = plan_of(CFG_4B, {"vllm_mode": "server", "policy_server_gpus": "1", "per_device_train_batch_size": "1",
                            "gradient_accumulation_steps": "25"})  # fmt: skip
    assert plan.layout.policy_server_gpu_ids == [2] and plan.layout.training_gpu_ids == [3, 4, 5, 6, 7]
    assert plan.layout.num_processes == 5 and "vLLM share" not in format_plan(plan)
    assert plan_of(CFG_4B, num_processes=3, gpus_per_node=8).layout.training_gpu_ids == [2, 3, 4]


def write_config(tmp_path: Path, model: str, **extra: str) -> Path:
    body = textwrap.dedent(f"""\
        model: {model}
        reader_gpus: 0
        deepspeed_stage: 0
        max_turns: 3
        observation_max_tokens: 256
        use_vllm: false
        bf16: true
        per_device_train_batch_size: 4
        num_generations: 4
        max_completion_length: 1536
        generation_kwargs:
          max_new_tokens: 48
        """)
    body += "".join(f"{k}: {v}\n" for k, v in extra.items())
    path = tmp_path / "tiny.yaml"
    path.write_text(body)
    return path


def test_local_tiny_model_is_read_from_config_json(tmp_path):
    from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

    folder = build_tiny_qwen3(tmp_path / "tiny", hidden_size=128, num_layers=2, seed=0)
    shape = model_shape(str(folder))
    assert shape.source.endswith("config.json")
    assert (shape.hidden, shape.layers, shape.intermediate, shape.kv_heads, shape.head_dim) == (128, 2, 512, 2, 64)
    assert shape.tied and shape.vocab == 8192
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        exact = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open has keys(), no __iter__)
    assert shape.params == exact  # parameters counted from the safetensors headers
    # model_params is ignored when the folder is local
    plan = plan_of(write_config(tmp_path, str(folder), model_params="9.0e+9"), gpus_per_node=2, gpu_memory_gb=24)
    assert plan.model.params == exact and plan.layout.num_processes == 2
    assert "fits: yes" in format_plan(plan) and "max_new_tokens" in format_plan(plan)


def test_safetensors_params_sum_every_shard_from_the_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    from coordrl.train.plan import _safetensors_params

    assert _safetensors_params(tmp_path) is None  # no safetensors: the caller estimates from config.json
    # Two shards, mixed dtypes, a scalar, an empty tensor and file metadata: 3*4 + 5 + 1 + 2*2*2 + 0 = 26.
    save_file(
        {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5), "s": torch.tensor(1.0)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
        metadata={"format": "pt"},
    )
    save_file(
        {"c": torch.zeros(2, 2, 2, dtype=torch.float16), "e": torch.zeros(0, 3)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    assert _safetensors_params(tmp_path) == 26


def test_cpu_config_plans_without_gpu_check(tmp_path):
    from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

    folder = build_tiny_qwen3(tmp_path / "tiny", hidden_size=128, num_layers=2)
    plan = plan_of(write_config(tmp_path, str(folder), use_cpu="true", bf16="false"), gpu_memory_gb=1)
    assert plan.layout.device == "cpu" and plan.layout.num_processes == 1
    assert "fits: yes (CPU run" in format_plan(plan)


def test_plan_command_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "coordrl.cli.plan", str(CFG_8B)], capture_output=True, text=True)
    assert ok.returncode == 0 and "fits: yes" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "coordrl.cli.plan", str(CFG_8B), "--gpu-memory-gb", "40"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "memory" in bad.stderr and "fits: NO" in bad.stdout


def test_accelerate_configs_parse():
    from accelerate.commands.config.config_args import load_config_from_file

    for stage in (2, 3):
        cfg = load_config_from_file(str(ROOT / "configs" / f"zero{stage}.yaml"))
        assert cfg.distributed_type == "DEEPSPEED" and cfg.mixed_precision == "bf16"
        assert cfg.deepspeed_config["zero_stage"] == stage


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "GPUS_PER_NODE": "8", **env}
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, env=full_env, timeout=120)


def test_launch_print_only_gpu_split():
    res = launch("--print-only", str(CFG_4B), "--max_steps", "2")
    assert res.returncode == 0, res.stderr
    lines = {line.split(":", 1)[0]: line for line in res.stdout.splitlines()}
    assert "serve-readers --model Qwen/Qwen3-4B-Instruct-2507 --gpus 0,1 " in lines["readers"]
    assert "--urls-file" in lines["readers"]
    train = lines["train"]
    assert "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 " in train and "accelerate launch" in train
    assert "--config_file " + str(ROOT / "configs" / "zero3.yaml") in train and "--num_processes 6 " in train
    assert f"-m coordrl.cli train --config {CFG_4B} --readers " in train and train.endswith("--max_steps 2")
    assert "coordrl.cli.plan" in lines["plan"]


def test_launch_print_only_overrides_and_multinode():
    res = launch(str(CFG_8B), "--reader_gpus", "3", "--deepspeed_offload=true", DRY_RUN="1", NUM_NODES="2",
                 NODE_RANK="1", MAIN_PROCESS_IP="10.0.0.1")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "--gpus 0,1,2 " in res.stdout and "CUDA_VISIBLE_DEVICES=3,4,5,6,7 " in res.stdout
    assert (
        "--num_processes 10 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29500"
        in res.stdout
    )
    assert "--offload_optimizer_device cpu --offload_param_device cpu" in res.stdout
    res = launch("--print-only", str(CFG_4B), "--reader_gpus", "0", "--deepspeed_stage", "2")
    assert "serve-readers" not in res.stdout and "zero2.yaml" in res.stdout and "--num_processes 8 " in res.stdout
    assert launch("--print-only", str(CFG_4B), "--reader_gpus", "8").returncode == 2
    assert launch("--print-only", str(CFG_4B), NUM_NODES="2").returncode == 2  # no MAIN_PROCESS_IP


FAKE_PYTHON = """#!/usr/bin/env bash
# Fake interpreter: `-m coordrl.cli serve-readers` pretends to serve; anything else runs the real Python.
if [ "$1" = "-m" ] && [ "$2" = "coordrl.cli" ] && [ "$3" = "serve-readers" ]; then
  shift 3
  while [ $# -gt 0 ]; do case "$1" in --urls-file) urls="$2"; shift 2;; *) shift;; esac; done
  echo $$ > "$FAKE_DIR/reader.pid"
  trap 'echo stopped > "$FAKE_DIR/reader.stopped"; rm -f "$urls"; exit 0' TERM
  sleep 0.5
  printf 'http://127.0.0.1:8100\\nhttp://127.0.0.1:8101\\n' > "$urls"
  while true; do sleep 0.1; done
fi
exec "$REAL_PYTHON" "$@"
"""

FAKE_ACCELERATE = """#!/usr/bin/env bash
# Fake accelerate: records how it was called, checks the readers are still up, exits with $FAKE_RC.
echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*" > "$FAKE_DIR/accelerate.args"
kill -0 "$(cat "$FAKE_DIR/reader.pid")" && echo alive > "$FAKE_DIR/reader.alive_during_training"
exit "${FAKE_RC:-0}"
"""


@pytest.mark.parametrize("rc", [0, 3])
def test_launch_runs_readers_then_training_and_stops_readers(tmp_path, rc):
    fake_py, fake_acc = tmp_path / "python", tmp_path / "accelerate"
    fake_py.write_text(FAKE_PYTHON)
    fake_acc.write_text(FAKE_ACCELERATE)
    fake_py.chmod(0o755)
    fake_acc.chmod(0o755)
    res = launch(str(CFG_4B), "--max_steps", "2", PYTHON=str(fake_py), ACCELERATE=str(fake_acc),
                 REAL_PYTHON=sys.executable, FAKE_DIR=str(tmp_path), FAKE_RC=str(rc), GPU_MEMORY_GB="80",
                 RUN_DIR=str(tmp_path / "run"), READER_STOP_GRACE_S="10")  # fmt: skip
    assert res.returncode == rc, res.stderr
    assert "fits: yes" in res.stdout  # the plan check ran first
    args = (tmp_path / "accelerate.args").read_text()
    assert args.startswith("CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 launch --config_file")
    assert "--readers http://127.0.0.1:8100,http://127.0.0.1:8101 --max_steps 2" in args
    assert (tmp_path / "reader.alive_during_training").exists()
    pid = int((tmp_path / "reader.pid").read_text())
    deadline = time.time() + 10
    while time.time() < deadline and (tmp_path / "reader.stopped").exists() is False:
        time.sleep(0.1)
    assert (tmp_path / "reader.stopped").exists()  # SIGTERM reached the fleet
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_hmars_recipe_plans_on_8x80gb():
    plan = plan_of(ROOT / "configs" / "hmars_qwen3_8b_8xh100.yaml", gpus_per_node=8, gpu_memory_gb=80)
    assert format_plan(plan).splitlines()[-1].startswith("fits: yes (")
    assert plan.layout.training_gpu_ids == [2, 3, 4, 5, 6, 7] and plan.budget.max_turns == 1
    assert not plan.errors


def test_kept_warm_starts_are_sized_from_their_shipped_folders():
    # `coordrl train --dry-run` on the world configs: the kept warm starts are no hub ids to look up.
    from coordrl.rollout.models import HMARS_WORLD_MODEL, WORLD_MODEL, WORLD_ONE_DOC_MODEL, resolve_model

    for name in (WORLD_MODEL, WORLD_ONE_DOC_MODEL, HMARS_WORLD_MODEL):
        shape = model_shape(name)
        assert shape.source == str(Path(resolve_model(name)) / "config.json")
        assert 1e6 < shape.params < 5e6 and shape.head_dim == 64
    plan = plan_of(ROOT / "configs" / "world_cpu.yaml")
    assert plan.layout.device == "cpu" and plan.model.params == model_shape(WORLD_MODEL).params
