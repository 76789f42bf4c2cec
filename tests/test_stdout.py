"""Every command's stdout is its own output: library chatter (transformers announces wandb offline
mode with a print at import) goes to stderr, so `--json` output and shell pipelines work.

Fresh interpreters: the chatter happens once per process, at the first import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHATTER = "Running in WANDB offline mode"


def coordrl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "coordrl.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def test_train_dry_run_prints_only_the_plan():
    r = coordrl("train", "--config", "configs/tiny_cpu.yaml", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("coordrl training plan: configs/tiny_cpu.yaml")
    assert CHATTER not in r.stdout
    # The notice is not lost, it is where logs go.
    assert CHATTER in r.stderr


def test_answer_json_is_parseable(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Document 1:\nAda\nAda was born in the city of Turin.\n", encoding="utf-8")
    r = coordrl("answer", "--policy", "scripted", "--document", str(doc), "--question", "Where was Ada born?", "--json")
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"answer", "trace", "info"}
