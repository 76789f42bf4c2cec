"""Human-readable view of one built sample (`coordrl data show`)."""

from __future__ import annotations

from pathlib import Path

from coordrl.data.errors import DataError


def load_built(folder: str | Path):
    """Load a dataset folder written by `coordrl data build` or one sweep subset (Arrow, no pickles)."""
    import datasets

    folder = Path(folder)
    if not (folder / "state.json").exists():
        hint = " (a sweep folder: pass one of its subset folders)" if (folder / "sweep.json").exists() else ""
        raise DataError(f"{folder} is not a dataset folder written by coordrl{hint}")
    return datasets.load_from_disk(str(folder))


def show_sample(folder: str | Path, index: int = 0, max_chars: int = 1500) -> str:
    ds = load_built(folder)
    if not 0 <= index < len(ds):
        raise DataError(f"--index {index} out of range: {folder} holds {len(ds)} samples")
    s = ds[index]
    ctx = s["context"]
    shown = ctx if len(ctx) <= max_chars else ctx[:max_chars] + f"\n[... {len(ctx) - max_chars:,} more characters]"
    facts = ", ".join(f"{f['title']!r} s{f['sent_id']} (Document {f['document']})" for f in s["supporting_facts"])
    return "\n".join(
        [
            f"sample {index} of {len(ds)}: id {s['id']} ({s['dataset']}, {s['type'] or 'untyped'}{', ' + s['variant'] if s['variant'] else ''})",
            f"question: {s['question']}",
            f"answers: {s['answers']}",
            "gold: " + ", ".join(f"{t!r} = Document {d}" for t, d in zip(s["gold_titles"], s["gold_documents"])),
            f"supporting facts: {facts}",
            f"{s['num_paragraphs']} paragraphs, {s['num_tokens']:,} tokens, seed {s['seed']}, sample index {s['sample_index']}",
            "context:",
            shown,
        ]
    )
