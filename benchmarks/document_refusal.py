"""Refusing an over-long document: time and memory, exact token count vs the length bound.

A 3-million-word document (HotpotQA paragraphs from the shipped pool, repeated, laid out as
``Document i:`` blocks) goes to ``Coordinator.answer`` with the default limit of 1,000,000 tokens.
``full`` is the former check (tokenize the whole document, then compare); ``bound`` is the current
one (`coordrl.data.tokens.max_chars_per_token`: refuse from the length alone when it is certainly
over the limit); ``windows`` is the current one without the length bound, as for a tokenizer whose
longest token makes the bound weak (`count_tokens_up_to`: counted in windows, stopping past the
limit). Each runs in a fresh process so peak RSS is its own; the growth over the process's RSS with
the document already built is what the check cost. Target: peak growth <= 2x the document.

    python benchmarks/document_refusal.py [--words 3000000] [--limit 1000000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from importlib import resources

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def build_document(words: int) -> str:
    from coordrl.data.layout import Paragraph, join_sentences, render_context

    pool = resources.files("coordrl").joinpath("resources", "data", "paragraph_pool.jsonl.gz")
    with gzip.open(str(pool), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    base = [Paragraph(r["title"], join_sentences(r["sentences"]) if r.get("sentences") else r["text"]) for r in rows]
    paragraphs, total = [], 0
    while total < words:
        for p in base:
            paragraphs.append(p)
            total += len(p.text.split())
            if total >= words:
                break
    return render_context(paragraphs)[0]


def measure(mode: str, words: int, limit: int) -> dict:
    from coordrl.inference.coordinator import Coordinator, InputError

    coord = Coordinator.from_pretrained("scripted", max_document_tokens=limit)
    coord.answer("Document 1:\nParis\nParis is in France.", "Where is Paris?")  # one-time setup
    document = build_document(words)
    if mode == "windows":
        coord._chars_per_token = None  # no length bound
    base = rss_bytes()
    traced = None
    if mode != "full":  # tracing would slow the full count's millions of allocations; RSS says enough there
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        if mode == "full":  # the former check, verbatim
            n_tokens = len(coord.tokenizer(document, add_special_tokens=False)["input_ids"])
            if n_tokens > limit:
                raise InputError(f"document has {n_tokens:,} tokens, more than the limit of {limit:,}")
        else:
            coord.answer(document, "Who wrote it?")
        outcome = "accepted"
    except InputError as e:
        outcome = str(e)
    seconds = time.perf_counter() - t0
    if mode != "full":
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return {
        "mode": mode, "seconds": seconds, "rss_growth": rss_bytes() - base, "traced_peak": traced,
        "document_bytes": len(document.encode("utf-8")), "characters": len(document), "outcome": outcome,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=3_000_000)
    ap.add_argument("--limit", type=int, default=1_000_000)
    ap.add_argument("--mode", choices=("full", "windows", "bound"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.words, args.limit)))
        return 0
    print(
        f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}; {args.words:,} words, limit {args.limit:,} tokens"
    )
    for mode in ("full", "windows", "bound"):
        cmd = [sys.executable, __file__, "--mode", mode, "--words", str(args.words), "--limit", str(args.limit)]
        out = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
        size = out["document_bytes"]
        print(
            f"{mode:>7}: {out['seconds']:.3f} s, peak RSS growth {out['rss_growth'] / 1e6:,.1f} MB "
            f"({out['rss_growth'] / size:.2f}x the {size / 1e6:,.1f} MB document)"
            + (f", Python-traced peak {out['traced_peak']:,} B" if out["traced_peak"] is not None else "")
            + f"; {out['outcome'][:100]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
