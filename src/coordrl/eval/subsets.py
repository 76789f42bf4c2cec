"""What ``coordrl eval --data`` names: the subsets of a sweep folder, or one dataset folder."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from coordrl.data.errors import DataError
from coordrl.data.show import load_built

__all__ = ["SubsetSpec", "discover_subsets"]


@dataclass
class SubsetSpec:
    """One dataset of the evaluation: ``name`` is its folder name (and trace file)."""

    name: str
    variant: str
    kind: str
    value: str
    folder: Path
    paragraphs: float | None = None


def discover_subsets(data: str | Path) -> list[SubsetSpec]:
    """The subsets of a sweep folder (from ``sweep.json``), or the one dataset folder given."""
    data = Path(data)
    manifest = data / "sweep.json"
    if manifest.exists():
        try:
            subsets = json.loads(manifest.read_text())["subsets"]
        except (ValueError, KeyError) as e:
            raise DataError(f"{manifest}: not a coordrl sweep manifest ({e})") from None
        out = []
        for s in subsets:
            kind, _, value = str(s["variant"]).partition("=")
            paragraphs = float(value) if kind == "length" else (s.get("stats") or {}).get("paragraphs", {}).get("mean")
            out.append(SubsetSpec(s["folder"], s["variant"], kind, value, data / s["folder"], paragraphs))
        return out
    if (data / "state.json").exists():
        ds = load_built(data)
        variant = ds[0]["variant"] if len(ds) and "variant" in ds.column_names and ds[0]["variant"] else ""
        paragraphs = (
            statistics.median(ds["num_paragraphs"]) if "num_paragraphs" in ds.column_names and len(ds) else None
        )
        if variant:
            kind, _, value = variant.partition("=")
        else:
            kind, value = "length", str(int(paragraphs or 0))
        return [
            SubsetSpec(
                data.name,
                variant or f"length={value}",
                kind,
                value,
                data,
                paragraphs if kind != "length" else float(value),
            )
        ]
    raise DataError(f"--data {data}: neither a sweep folder (sweep.json) nor a dataset folder written by coordrl")
