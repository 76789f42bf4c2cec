"""Paths to the real data sample shipped inside the package (see resources/data/ATTRIBUTION.md)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_DATA = "resources/data"

SHIPPED_FILES = {
    "hotpotqa": "hotpot_dev_distractor_v1.sample396.json.gz",
    "hotpotqa-train": "hotpot_train_v1.1.sample100.json.gz",
    "2wikimultihopqa": "2wikimultihopqa_dev.sample500.json.gz",
    "pool": "paragraph_pool.jsonl.gz",
}


def shipped_path(key: str) -> Path:
    """Filesystem path of a shipped data file (``hotpotqa``, ``hotpotqa-train``, ``2wikimultihopqa``, ``pool``)."""
    if key not in SHIPPED_FILES:
        raise KeyError(f"no shipped data file {key!r}; known: {sorted(SHIPPED_FILES)}")
    return Path(str(resources.files("coordrl").joinpath(_DATA, SHIPPED_FILES[key])))
