"""Resuming an evaluation: the settings a rerun into the same ``--out`` must match (``eval_config.json``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from coordrl.data.errors import DataError
from coordrl.eval.config import EvalConfig

__all__ = ["EVAL_CONFIG", "check_resume", "episode_settings", "fingerprint"]

EVAL_CONFIG = "eval_config.json"
# Settings that change what an episode does: a rerun into the same --out must match them.
_FINGERPRINT_KEYS = (
    "policy",
    "baseline",
    "weights",
    "data",
    "readers",
    "reader_model",
    "max_turns",
    "chunk_tokens",
    "chunk_overlap_tokens",
    "activation",
    "max_new_tokens",
    "temperature",
    "seed",
    "context_window",
    "max_completion_tokens",
    "hmars",
)


def fingerprint(
    cfg: EvalConfig, source, weights: str | None, max_new_tokens: int, window: int | None
) -> dict[str, Any]:
    return {
        "policy": str(Path(source.path).resolve()) if source.path and Path(source.path).exists() else source.spec,
        "baseline": cfg.baseline,
        "weights": weights,
        "data": str(Path(cfg.data).resolve()),
        **episode_settings(cfg, max_new_tokens, window),
        "hmars": cfg.hmars,  # None for PARSER: earlier PARSER evaluations still resume
    }


def episode_settings(cfg: EvalConfig, max_new_tokens: int, window: int | None) -> dict[str, Any]:
    """What decides an episode's outcome: the resume fingerprint and ``results.json`` both record it."""
    return {
        "readers": cfg.readers,
        "reader_model": cfg.reader_model,
        "max_turns": cfg.max_turns,
        "chunk_tokens": cfg.chunk_tokens,
        "chunk_overlap_tokens": cfg.chunk_overlap_tokens,  # None: the policy's own (earlier runs still resume)
        "activation": cfg.activation,  # None: the policy's own, as for the overlap
        "max_new_tokens": max_new_tokens,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "context_window": window,
        "max_completion_tokens": cfg.max_completion_tokens,
    }


def check_resume(out: Path, fingerprint: dict[str, Any], overwrite: bool) -> None:
    path = out / EVAL_CONFIG
    if overwrite:
        for name in ("traces", "results.json", "results.md", "accuracy_vs_length.png", EVAL_CONFIG):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        return
    if not path.exists():
        if (out / "traces").exists() and any((out / "traces").iterdir()):
            raise DataError(f"{out} holds traces but no {EVAL_CONFIG}; pass --overwrite or another --out")
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        raise DataError(f"{path} is not valid JSON; pass --overwrite or another --out") from None
    for key in _FINGERPRINT_KEYS:
        if old.get(key) != fingerprint.get(key):
            raise DataError(
                f"{out} holds an evaluation with other settings ({key}: {old.get(key)!r} there, {fingerprint.get(key)!r} now); "
                "pass --overwrite or another --out"
            )
