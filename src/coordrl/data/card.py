"""Dataset cards (README.md in every output folder) and the statistics they report."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from coordrl.data.schema import SAMPLE_FIELDS

ATTRIBUTION = (
    "HotpotQA (Yang et al., 2018) CC BY-SA 4.0; 2WikiMultiHopQA (Ho et al., 2020) Apache-2.0; "
    "MuSiQue (Trivedi et al., 2022) CC BY 4.0; Wikipedia paragraph text CC BY-SA. "
    "Samples built from these sources carry their licences."
)


@dataclass
class SubsetStats:
    """Running statistics of one written dataset."""

    samples: int = 0
    paragraphs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    gold_bins: Counter = field(default_factory=Counter)  # relative gold position, 10 bins
    types: Counter = field(default_factory=Counter)
    questions: set[str] = field(default_factory=set)

    def add(self, sample: dict[str, Any]) -> None:
        self.samples += 1
        n = sample["num_paragraphs"]
        self.paragraphs.append(n)
        self.tokens.append(sample["num_tokens"])
        self.types[sample["type"] or "unknown"] += 1
        self.questions.add(sample["source_id"])
        for doc in sample["gold_documents"]:
            self.gold_bins[min(9, (doc - 1) * 10 // max(n, 1))] += 1

    def summary(self) -> dict[str, Any]:
        def describe(values: list[int]) -> dict[str, float]:
            if not values:
                return {}
            return {
                "min": min(values),
                "median": statistics.median(values),
                "mean": round(statistics.fmean(values), 1),
                "max": max(values),
            }

        return {
            "samples": self.samples,
            "unique_questions": len(self.questions),
            "paragraphs": describe(self.paragraphs),
            "tokens": describe(self.tokens),
            "total_tokens": sum(self.tokens),
            "types": dict(sorted(self.types.items())),
            "gold_position_deciles": [self.gold_bins.get(i, 0) for i in range(10)],
        }


def _stats_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| subset | samples | questions | paragraphs (min / mean / max) | tokens (min / median / mean / max) |",
        "|---|---|---|---|---|",
    ]
    for name, s in rows:
        p, t = s["paragraphs"], s["tokens"]
        lines.append(
            f"| {name} | {s['samples']} | {s['unique_questions']} | {p['min']} / {p['mean']} / {p['max']} "
            f"| {t['min']} / {t['median']} / {t['mean']} / {t['max']} |"
        )
    return lines


def render_card(
    title: str, recipe: dict[str, Any], load: dict[str, Any], subsets: list[tuple[str, dict[str, Any]]]
) -> str:
    """Markdown card. Holds nothing that depends on the machine, the clock or the worker count."""
    lines = [f"# {title}", "", "Built by coordrl. Load with `datasets.load_from_disk(<folder>)`.", "", "## Recipe", ""]
    lines += [f"- {k}: `{v}`" for k, v in recipe.items()]
    lines += ["", "## Source", ""]
    lines += [f"- {k}: `{v}`" for k, v in load.items() if k != "skip_examples"]
    if load.get("skip_examples"):
        lines += ["", "Skipped records (first ones):", ""] + [f"- {e}" for e in load["skip_examples"]]
    lines += ["", "## Statistics", ""] + _stats_table(subsets)
    lines += [
        "",
        "Gold paragraphs per tenth of the document (Document 1 first); a uniform spread means no position prior:",
        "",
    ]
    for name, s in subsets:
        lines.append(f"- {name}: {s['gold_position_deciles']}")
    lines += ["", "## Fields", "", "| field | meaning |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in SAMPLE_FIELDS.items()]
    lines += ["", "## Licences", "", ATTRIBUTION, ""]
    return "\n".join(lines)
