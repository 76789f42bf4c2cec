"""Data pipeline throughput and memory: prints samples/s, wall time and peak RSS.

Targets (2-core machine): 32,768 training samples at 200 paragraphs from a pool of at
least 25K paragraphs in <= 10 minutes with peak memory <= 4 GB; the 8-length sweep of 128
questions in <= 5 minutes. Questions repeat in the training benchmark (the shipped sample has 396).

    python benchmarks/data_build.py [--samples 32768] [--workers 2] [--out /tmp/coordrl-bench] [--skip-sweep]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from coordrl.data.build import BuildConfig, SweepConfig, build_dataset, build_sweep


def peak_rss_gb() -> tuple[float, float]:
    """(this process, largest child) peak resident set in GB; ru_maxrss is in KiB on Linux."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return own, kids


def du_gb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32768)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/coordrl-bench"))
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the written datasets")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}")

    out = args.out / "train"
    t0 = time.perf_counter()
    stats = build_dataset(BuildConfig(num_samples=args.samples, workers=args.workers, overwrite=True), out)
    wall = time.perf_counter() - t0
    own, kids = peak_rss_gb()
    print(
        f"build: {stats['samples']} samples x 200 paragraphs, {stats['total_tokens']:,} tokens, {du_gb(out):.2f} GB on disk\n"
        f"build: wall {wall:.1f} s, {stats['samples'] / wall:.0f} samples/s, peak RSS main {own:.2f} GB, worker {kids:.2f} GB "
        f"(target <= 600 s, <= 4 GB)"
    )
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)

    if not args.skip_sweep:
        out = args.out / "sweep"
        t0 = time.perf_counter()
        manifest = build_sweep(SweepConfig(questions=128, workers=args.workers, overwrite=True), out)
        wall = time.perf_counter() - t0
        own, kids = peak_rss_gb()
        n = sum(s["stats"]["samples"] for s in manifest["subsets"])
        tokens = sum(s["stats"]["total_tokens"] for s in manifest["subsets"])
        print(
            f"sweep: 8 lengths x 128 questions = {n} samples, {tokens:,} tokens, {du_gb(out):.2f} GB on disk\n"
            f"sweep: wall {wall:.1f} s, {n / wall:.1f} samples/s, peak RSS main {own:.2f} GB, worker {kids:.2f} GB (target <= 300 s)"
        )
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
