"""The GPU check: does the training plan's memory estimate hold on a real GPU? (`scripts/gpu_check.sh` runs it.)

Stages, each recorded in ``<out>/gpu_check.json``:

1. ``tiny``: a few GRPO steps of the tiny random Qwen3 through ``coordrl train`` (``configs/tiny_cpu.yaml``:
   transformers generation, lexical readers, the shipped HotpotQA sample), bf16 on the GPU; passes when
   a checkpoint is written.
2. ``shape-4b``, ``shape-4b-full`` (then ``shape-8b`` while the time budget allows): a random-initialised model of the
   Qwen3-4B (8B) shape, trained with ``configs/parser_qwen3_4b_8xh100.yaml``'s per-device batch,
   gradient accumulation, generations and gradient checkpointing in one process: no vLLM (transformers
   generation), no DeepSpeed, lexical readers, one optimizer step. Every rollout is generated to
   ``--completion-tokens`` (a random model almost never emits EOS among 151,936 ids), so the trained
   sequences have the length the plan assumes. Measured: peak allocated and reserved GPU memory
   (`torch.cuda.max_memory_allocated` / ``max_memory_reserved``) and TRL's step time. Planned:
   `coordrl.train.plan.make_plan` for exactly that config on one GPU of the device's size, whose
   total is the training process's memory. Printed as ``ratio: measured/planned = R``, with reserved
   memory as the measure (what the process takes from the GPU). ``shape-4b-full`` trains at the
   config's own 20,480-token completions without generating them (`random_rollouts` returns random
   ordinary ids at once) and is compared with the plan's training phase alone.

``--cpu-smoke`` runs the same stages on the CPU with tiny shapes (the "4B" stage becomes a 2-layer,
64-wide model, 2 rollouts of 32 tokens): the measure is then the process's peak resident memory, so
its ratio only shows that the code path runs (CI keeps it from rotting).

Generated rollouts are capped at ``--completion-tokens`` (default 4,096) rather than the config's
20,480: transformers generation of 20 sequences of 20K tokens would take most of the 10 minutes a lent
GPU gives. The plan is computed for the same cap, so the ratio compares like with like; the full
length is measured by ``shape-4b-full``, training phase only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARSER_CONFIG = ROOT / "configs" / "parser_qwen3_4b_8xh100.yaml"
GIB = 1024**3

# Qwen3 dense shapes (config.json of Qwen/Qwen3-4B and Qwen/Qwen3-8B): hidden, layers, heads, KV heads,
# head_dim, intermediate, vocabulary, tied embeddings.
SHAPES = {
    "4b": dict(hidden=2560, layers=36, heads=32, kv=8, head_dim=128, inter=9728, vocab=151936, tied=True),
    "8b": dict(hidden=4096, layers=36, heads=32, kv=8, head_dim=128, inter=12288, vocab=151936, tied=False),
    "smoke": dict(hidden=64, layers=2, heads=2, kv=1, head_dim=32, inter=128, vocab=None, tied=True),
}


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


def run_tiny(out: Path, cpu: bool, steps: int) -> dict[str, Any]:
    """Stage 1: ``coordrl train`` of the tiny policy, in a subprocess as a user runs it."""
    run_dir = out / "tiny"
    cmd = [
        sys.executable, "-m", "coordrl.cli", "train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
        "--use_cpu", str(cpu).lower(), "--bf16", str(not cpu).lower(), "--max_steps", str(steps),
        "--save_steps", str(steps), "--output_dir", str(run_dir), "--report_to", "none", "--overwrite",
    ]  # fmt: skip
    t0 = time.time()
    with open(out / "tiny_train.log", "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    ckpt = sorted(run_dir.glob("checkpoint-*"))
    ok = rc == 0 and bool(ckpt)
    log(
        f"tiny: coordrl train {steps} steps: {'OK' if ok else 'FAIL'} (exit {rc}, {time.time() - t0:.0f}s, log {out / 'tiny_train.log'})"
    )
    return {"ok": ok, "exit": rc, "seconds": round(time.time() - t0, 1), "checkpoint": str(ckpt[-1]) if ckpt else None}


def build_random_model(folder: Path, shape: dict[str, Any], cpu: bool) -> None:
    """A random-initialised Qwen3 of ``shape`` (bf16 on the GPU, fp32 on CPU) with coordrl's shipped tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from coordrl.data.tokens import load_tokenizer

    tok = load_tokenizer(None)
    config = Qwen3Config(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["inter"],
        vocab_size=shape["vocab"] or len(tok),
        tie_word_embeddings=shape["tied"],
        max_position_embeddings=40960,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    dtype = torch.float32 if cpu else torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cpu" if cpu else "cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    del model
    if not cpu:
        torch.cuda.empty_cache()


def shape_overrides(model: Path, out: Path, cpu: bool, completion_tokens: int) -> dict[str, Any]:
    """The PARSER 4B config, one process: no vLLM, no DeepSpeed, lexical readers, one optimizer step,
    every rollout ``completion_tokens`` long."""
    over: dict[str, Any] = {
        "model": str(model),
        "model_params": "null",
        "readers": "lexical",
        "reader_model": "null",
        "reader_gpus": "0",
        "deepspeed_stage": "0",
        "train_data": "sample",
        "sample_num_paragraphs": "50",
        "eval_data": "null",
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "log_completions": "false",
        "use_vllm": "false",
        "max_steps": "1",
        "max_turns": "1",
        "allow_truncated_rollouts": "true",
        "traces": "false",
        "output_dir": str(out),
        "max_completion_length": str(completion_tokens),
        # A random model almost never emits EOS: min = max makes every rollout the planned length.
        "generation_kwargs": {"max_new_tokens": completion_tokens, "min_new_tokens": completion_tokens},
    }
    if cpu:
        over.update(
            use_cpu="true", bf16="false", per_device_train_batch_size="2", gradient_accumulation_steps="1",
            num_generations="2", per_device_eval_batch_size="2",
        )  # fmt: skip
    return over


def random_rollouts(base: type, length: int, seed: int = 0) -> type:
    """A trainer class whose generator returns ``length`` random ordinary token ids per rollout at once
    (no EOS, no tool call): the training pass then runs at the config's full sequence length without
    spending minutes generating it. Only the generator seam is replaced; TRL's loss, masking and
    optimizer step run unchanged."""
    import random

    rng = random.Random(seed)

    class RandomRollouts(base):
        def _backend_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            if not hasattr(self, "_ordinary_ids"):  # the vocabulary minus special tokens, once per trainer
                tok = self.processing_class
                special = set(tok.all_special_ids)
                self._ordinary_ids = [i for i in range(len(tok)) if i not in special]
            return [[rng.choice(self._ordinary_ids) for _ in range(length)] for _ in prompt_ids], None

    return RandomRollouts


def run_shape(
    name: str, out: Path, cpu: bool, completion_tokens: int, gpu_gib: float, full_length: int | None = None
) -> dict[str, Any]:
    """Stage 2: one optimizer step of a random model of shape ``name``; measured against planned memory.

    ``full_length``: instead of generating, every rollout is ``full_length`` random ids (`random_rollouts`),
    and the measure is compared with the plan's training phase (overhead, weights, gradients, optimizer,
    activations, LM head), since no generation ran."""
    import torch

    from coordrl.train.config import load_config
    from coordrl.train.plan import make_plan
    from coordrl.train.run import train
    from coordrl.train.trainer import CoordGRPOTrainer

    t0 = time.time()
    model_dir = out / f"model-{name}"
    if not (model_dir / "config.json").exists():
        build_random_model(model_dir, SHAPES["smoke" if cpu else name], cpu)
    built_s = time.time() - t0
    tokens = full_length or completion_tokens
    stage = f"{name}-full" if full_length else name
    overrides = shape_overrides(model_dir, out / f"run-{stage}", cpu, tokens)
    cfg = load_config(PARSER_CONFIG, overrides)
    plan = make_plan(cfg, num_processes=1, gpus_per_node=1, gpu_memory_gb=gpu_gib, check=False)
    full = make_plan(
        load_config(PARSER_CONFIG, {**overrides,
                                    "max_completion_length": "20480", "generation_kwargs": {"max_new_tokens": 1024}}),
        num_processes=1, gpus_per_node=1, gpu_memory_gb=gpu_gib, check=False,
    )  # fmt: skip
    seen: list[Any] = []

    class Recording(random_rollouts(CoordGRPOTrainer, full_length) if full_length else CoordGRPOTrainer):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            seen.append(self)

    start_reserved = 0.0
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
        start_reserved = float(torch.cuda.memory_reserved())  # what earlier stages left cached (should be ~0)
    t1 = time.time()
    train(cfg, overwrite=True, trainer_cls=Recording)
    train_s = time.time() - t1
    if cpu:
        measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        allocated = reserved = float(measured)
        measure = "peak resident memory of the process (CPU smoke: shows the path runs, not the plan)"
    else:
        allocated, reserved = float(torch.cuda.max_memory_allocated()), float(torch.cuda.max_memory_reserved())
        measure = "torch.cuda.max_memory_reserved"
    history = seen[0].state.log_history if seen else []
    step_times = [h["step_time"] for h in history if h.get("step_time") is not None]
    m = plan.memory
    if full_length:  # no generation ran: the training phase alone
        planned = m.overhead + sum(x for _, x, _ in m.persistent) + sum(x for _, x, _ in m.train_phase)
    else:
        planned = m.total
    ratio = reserved / planned
    result = {
        "shape": SHAPES["smoke" if cpu else name],
        "params": plan.model.params,
        "rollouts": f"{tokens} random ids, not generated" if full_length else f"generated, {tokens} tokens",
        "planned_phase": "training phase" if full_length else "total (generation phase included)",
        "config_overrides": overrides,
        "per_device_train_batch_size": plan.batch.per_device_train_batch_size,
        "gradient_accumulation_steps": plan.batch.gradient_accumulation_steps,
        "seq_len_planned": plan.budget.seq_len,
        "measured_allocated_gib": allocated / GIB,
        "measured_reserved_gib": reserved / GIB,
        "measure": measure,
        "reserved_at_start_gib": start_reserved / GIB,
        "planned_gib": planned / GIB,
        "planned_terms_gib": {
            "overhead": plan.memory.overhead / GIB,
            **{k: v / GIB for k, v, _ in plan.memory.persistent},
            **{k: v / GIB for k, v, _ in plan.memory.train_phase},
            **{k: v / GIB for k, v, _ in plan.memory.generation_phase},
        },
        "planned_full_config_gib": full.memory.total / GIB,
        "ratio_reserved": ratio,
        "ratio_allocated": allocated / planned,
        "step_time_s": step_times[-1] if step_times else None,
        "model_build_s": round(built_s, 1),
        "train_s": round(train_s, 1),
    }
    label = stage + (" (CPU smoke: a 2-layer stand-in)" if cpu else "")
    log(
        f"{label}: {plan.model.params / 1e6:,.1f}M params, B={result['per_device_train_batch_size']} x "
        f"{result['gradient_accumulation_steps']} accumulation, S={result['seq_len_planned']}: measured "
        f"{reserved / GIB:.2f} GiB reserved ({allocated / GIB:.2f} allocated), planned {planned / GIB:.2f} GiB "
        f"(full config: {full.memory.total / GIB:.2f}); step {result['step_time_s'] or 0:.1f}s"
    )
    print(f"ratio: measured/planned = {ratio:.3f} ({stage}{', CPU smoke' if cpu else ''})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json, logs and the stage runs")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (no CUDA needed)")
    p.add_argument("--completion-tokens", type=int, default=None, help="rollout length (default 4096; smoke 32)")
    p.add_argument("--tiny-steps", type=int, default=2, help="GRPO steps of the tiny stage (default 2)")
    p.add_argument(
        "--full-tokens",
        type=int,
        default=None,
        help="rollout length of the 4B full-length stage (default: the config's 20480; smoke 256)",
    )
    p.add_argument(
        "--budget-s", type=float, default=300.0, help="start the 8B stage only before this many seconds (default 300)"
    )
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    cpu = a.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        log("torch.cuda.is_available() is False: run on a CUDA host, or pass --cpu-smoke")
        return 2
    t0 = time.time()
    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    gpu_gib = 80.0 if cpu else torch.cuda.get_device_properties(0).total_memory / GIB
    report: dict[str, Any] = {
        "device": device,
        "gpu_memory_gib": gpu_gib,
        "torch": torch.__version__,
        "cpu_smoke": cpu,
        "stages": {},
    }
    log(f"device {device}, torch {torch.__version__}")
    tokens = a.completion_tokens or (32 if cpu else 4096)
    full = a.full_tokens or (256 if cpu else 20480)
    report["stages"]["tiny"] = run_tiny(out, cpu, a.tiny_steps)
    # 4B generated, 4B at the config's full length (training phase), then 8B generated if time allows.
    for stage, name, full_length in (("shape-4b", "4b", None), ("shape-4b-full", "4b", full), ("shape-8b", "8b", None)):
        if name == "8b" and (cpu or time.time() - t0 > a.budget_s):
            report["stages"][stage] = {"skipped": "CPU smoke" if cpu else f"time budget ({a.budget_s:.0f}s) spent"}
            continue
        try:
            report["stages"][stage] = run_shape(name, out, cpu, tokens, gpu_gib, full_length)
        except Exception as e:  # recorded, so the figures of the stages that ran still come back
            report["stages"][stage] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{stage}: FAILED: {type(e).__name__}: {e}")
        if not cpu:
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    report["seconds"] = round(time.time() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    ok = report["stages"]["tiny"]["ok"] and all(
        "error" not in report["stages"][k] for k in ("shape-4b", "shape-4b-full")
    )
    log(f"{'OK' if ok else 'FAIL'} in {report['seconds']:.0f}s; figures in {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
