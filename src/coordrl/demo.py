"""The README's main job on embedded defaults: offline, CPU, minutes.

Today it builds a distractor-packed training set and a small evaluation sweep from the real
HotpotQA sample shipped with coordrl, prints their statistics and shows one sample chunked the way
readers will see it. Training, evaluation and export join it as they land.
"""

from __future__ import annotations

import time
from pathlib import Path

from coordrl.data.build import BuildConfig, SweepConfig, build_dataset, build_sweep
from coordrl.data.chunk import chunk_context
from coordrl.data.show import load_built, show_sample
from coordrl.data.tokens import cached_counter


def _rule(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def run_demo(out: Path, workers: int = 1) -> int:
    t0 = time.perf_counter()
    out = Path(out)
    _rule("1/3 training set: shipped HotpotQA dev sample, 200 paragraphs per question (PARSER recipe)")
    stats = build_dataset(BuildConfig(seed=0, workers=workers, jsonl=False, overwrite=True), out / "train")
    p, t = stats["paragraphs"], stats["tokens"]
    print(
        f"{stats['samples']} samples, {p['mean']:.0f} paragraphs each, tokens median {t['median']:,.0f} "
        f"(min {t['min']:,}, max {t['max']:,}); gold paragraphs per tenth of the document: {stats['gold_position_deciles']}"
    )

    _rule("2/3 evaluation sweep: the same 8 questions at 50..6400 paragraphs, plus robustness controls")
    manifest = build_sweep(
        SweepConfig(questions=8, controls=["position", "order", "distance"], control_length=200, workers=workers, overwrite=True),
        out / "sweep",
    )
    for sub in manifest["subsets"]:
        s = sub["stats"]
        print(f"  {sub['variant']:<18} {s['samples']} samples, median {s['tokens']['median']:>9,.0f} tokens -> {out / 'sweep' / sub['folder']}")

    _rule("3/3 one training sample, and how 512-token reader chunks cover it")
    print(show_sample(out / "train", 0, max_chars=700))
    sample = load_built(out / "train")[0]
    chunks = chunk_context(sample["context"], cached_counter(None).tokenizer, 512, sample["doc_offsets"])
    gold_chunks = [c.index for c in chunks if set(c.documents) & set(sample["gold_documents"])]
    print(f"\n{len(chunks)} reader chunks of <= 512 tokens; gold Documents {sample['gold_documents']} sit in chunks {gold_chunks}")
    print(f"\ndone in {time.perf_counter() - t0:.0f} s; datasets and cards (README.md) under {out}")
    return 0
