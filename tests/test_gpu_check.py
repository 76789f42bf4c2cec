"""The GPU check's CPU smoke: `scripts/gpu_check.sh --cpu-smoke` runs every stage of the GPU check with tiny
shapes, so the script cannot rot between the sessions that are lent a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_runs_every_stage_and_prints_the_ratio(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio: measured/planned = " in proc.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cpu_smoke"] is True and report["device"] == "cpu"
    tiny = report["stages"]["tiny"]
    assert tiny["ok"] and Path(tiny["checkpoint"]).is_dir()
    shape = report["stages"]["shape-4b"]
    # The plan was made for the run that was measured: the same model (its parameters read from the
    # built folder), batch and sequence length.
    assert shape["params"] > 0 and shape["planned_gib"] > 0 and shape["measured_reserved_gib"] > 0
    assert shape["per_device_train_batch_size"] == 2 and shape["seq_len_planned"] > 32
    assert abs(shape["ratio_reserved"] - shape["measured_reserved_gib"] / shape["planned_gib"]) < 1e-9
    # The full-length stage trains on rollouts of the asked length without generating them, and is
    # compared with the plan's training phase, which leaves the generation KV cache out.
    full = report["stages"]["shape-4b-full"]
    assert full["rollouts"] == "256 random ids, not generated" and full["seq_len_planned"] > 256
    assert full["planned_phase"] == "training phase"
    training_terms = {k: v for k, v in full["planned_terms_gib"].items() if not k.startswith("KV cache")}
    assert len(training_terms) == len(full["planned_terms_gib"]) - 1
    assert abs(full["planned_gib"] - sum(training_terms.values())) < 1e-9
    assert "skipped" in report["stages"]["shape-8b"]


def test_gpu_check_refuses_to_run_without_cuda_unless_smoke(tmp_path):
    # No wheels to install (a developer's .gpu_wheels/ holds the GPU machine's Python 3.12 builds).
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "WHEELS": str(tmp_path / "none")}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--cpu-smoke" in proc.stdout + proc.stderr
