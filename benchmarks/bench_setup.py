"""What the shared-prefix benchmarks have in common: their command line and a kept policy on fixed threads."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

RESOURCES = Path(__file__).resolve().parents[1] / "src" / "coordrl" / "resources"


def batch_parser(doc: str) -> argparse.ArgumentParser:
    """``--threads``, ``--repeats``, ``--questions`` and ``--generations``, described by ``doc``'s first line."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--questions", type=int, default=2, help="prompts per batch (default 2, the CPU config's)")
    ap.add_argument("--generations", type=int, default=8, help="rollouts per prompt (default 8)")
    return ap


def load_policy(name: str, threads: int):
    """``(tokenizer, model)`` of the kept policy ``coordrl/resources/<name>`` in float32, torch on ``threads``."""
    torch.set_num_threads(threads)
    folder = RESOURCES / name
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), use_safetensors=True, dtype=torch.float32)
    return tok, model
