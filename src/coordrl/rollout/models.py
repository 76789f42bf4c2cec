"""Model names coordrl resolves itself and the markers of a training checkpoint.

Training writes checkpoints; evaluation, export and inference read them: both sides take these
names from here, below the two of them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from coordrl.data.errors import ConfigError

COMPLETE_MARKER = "COMPLETE"


CHECKPOINT_META = "coordrl_train.json"


TINY_MODEL = "coordrl:tiny-qwen3"


WORLD_MODEL = "coordrl:world-warm-start"  # the kept SFT warm start of the synthetic world
# The same, taught on one world document per reader chunk: the chunking model-served readers read.
WORLD_ONE_DOC_MODEL = "coordrl:world-warm-start-1doc"
HMARS_WORLD_MODEL = "coordrl:hmars-world-warm-start"  # the kept SFT warm start of the HMARS world's mid-agent
# Name -> folder in coordrl/resources.
KEPT_MODELS = {WORLD_MODEL: "warm_start", WORLD_ONE_DOC_MODEL: "warm_start_1doc", HMARS_WORLD_MODEL: "hmars_warm_start"}


def cache_dir() -> Path:
    return Path(os.environ.get("COORDRL_CACHE", Path.home() / ".cache" / "coordrl"))


def resolve_model(spec: str) -> str:
    """A model path: ``coordrl:tiny-qwen3`` is built locally once (random weights, offline); the
    ``coordrl:*-warm-start`` names are the kept warm starts shipped in ``coordrl/resources``."""
    if spec == TINY_MODEL:
        path = cache_dir() / "models" / "tiny-qwen3-seed0"
        if not (path / "model.safetensors").exists():
            # Lazy: building the model needs transformers and torch, which naming a model does not.
            from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

            build_tiny_qwen3(path, seed=0)
        return str(path)
    if spec in KEPT_MODELS:
        return str(Path(__file__).resolve().parents[1] / "resources" / KEPT_MODELS[spec])
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return spec
    if folder.exists():
        raise ConfigError(f"model: {spec} is a file; give a model folder or a hub id")
    if spec.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(spec):
        raise ConfigError(f"model: no such folder {spec} (and not a hub id of the form org/name)")
    return spec


# A Hugging Face hub id: ``org/name`` or a bare ``name``.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def latest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest ``checkpoint-<step>`` holding the COMPLETE marker (interrupted saves are ignored)."""
    output_dir = Path(output_dir)
    if not output_dir.exists():
        return None
    steps = []
    for p in output_dir.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and (p / COMPLETE_MARKER).exists():
            steps.append((int(m.group(1)), p))
    return max(steps)[1] if steps else None
