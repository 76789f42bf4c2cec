"""Routed reader activation against PARSER's broadcast: reader calls, gold-chunk recall, router latency.

Builds (or reuses) a sweep of HotpotQA dev questions from the shipped sample, packed with the shipped
paragraph pool to 200, 800, 3,200 and 6,400 paragraphs (about 1M tokens at 6,400), chunks every
context at ``--chunk-tokens`` (4,096, PARSER's evaluation size) and routes two query sets:

- ``question``: the question text as the only query;
- ``two-hop``: the question, then one query naming each bridge entity ("What is known about
  Shirley Temple?"), i.e. each gold paragraph title the question does not already name, as a lead
  asks once the first round has told it the bridge.

For each pathway alone and for their union (the default routed setting) it prints reader calls per
query against the broadcast (``reduction``), gold-chunk activation recall (share of chunks holding a
gold paragraph that some query of the question woke) and router latency per query with the index
cached. Offline; all choices are the sweep's seeded ones.

    python benchmarks/routing.py [--questions 64] [--data /tmp/coordrl-routing] [--chunk-tokens 4096]

Target (2 cores): at 6,400 paragraphs >= 10x fewer reader calls than broadcast at recall >= 0.95
with the CPU pathways (BM25 + summaries), router <= 20 ms per query with the index cached.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from coordrl.data.build import SweepConfig, build_sweep
from coordrl.data.chunk import chunk_context
from coordrl.data.show import load_built
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.parser import ParserEnvConfig
from coordrl.readers.routing import ChunkRouter, RouterSettings
from coordrl.rewards.metrics import nearest_rank_percentile

LENGTHS = (200, 800, 3200, 6400)
_DISAMBIGUATION = re.compile(r"\s*\([^()]*\)\s*$")


@dataclass
class Tally:
    """Calls and recall of one (pathway setting, query set) over the questions of one length."""

    routed_calls: int = 0
    broadcast_calls: int = 0
    recalls: list[float] = field(default_factory=list)

    def add(self, activated_per_query: list[tuple[int, ...]], n_chunks: int, gold: set[int]) -> None:
        self.routed_calls += sum(len(a) for a in activated_per_query)
        self.broadcast_calls += n_chunks * len(activated_per_query)
        woke = set().union(*activated_per_query)
        self.recalls.append(len(woke & gold) / len(gold))

    @property
    def reduction(self) -> float:
        return self.broadcast_calls / max(self.routed_calls, 1)

    @property
    def recall(self) -> float:
        return statistics.fmean(self.recalls)


def two_hop_queries(question: str, gold_titles: list[str]) -> list[str]:
    """The question, then one query per gold paragraph subject the question does not name."""
    names = [_DISAMBIGUATION.sub("", t) for t in gold_titles]
    return [question] + [f"What is known about {n}?" for n in names if n.lower() not in question.lower()]


def settings_under_test(default: RouterSettings) -> dict[str, RouterSettings]:
    """The default union and the union with each pathway removed (with two pathways: each alone)."""
    out = {"union (default)": default}
    for removed in default.pathways:
        kept = {p: default.top_k(p) if p != removed else 0 for p in ("bm25", "summary", "dense")}
        label = " + ".join(p for p in default.pathways if p != removed)
        out[f"{label} (no {removed})"] = replace(
            default, bm25_top_k=kept["bm25"], summary_top_k=kept["summary"], dense_top_k=kept["dense"]
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--data", type=Path, default=Path("/tmp/coordrl-routing"), help="sweep folder (built if absent)")
    ap.add_argument("--chunk-tokens", type=int, default=4096)
    ap.add_argument("--top-k", default="4,6,8,12", help="per-pathway top-k values swept at the largest length")
    ap.add_argument("--dense-url", help="an /v1/embeddings server: add the dense pathway to the union")
    ap.add_argument("--dense-model", help="the embedding model served at --dense-url")
    ap.add_argument("--dense-top-k", type=int, default=8)
    args = ap.parse_args()
    dense = {}
    if args.dense_url:
        dense = {"route_dense_top_k": args.dense_top_k, "route_dense_url": args.dense_url}
        dense["route_dense_model"] = args.dense_model
    default = ParserEnvConfig(activation="routed", **dense).router_settings()
    print(
        f"machine: {os.cpu_count()} cores; chunks of {args.chunk_tokens} tokens; routed setting: "
        + " + ".join(f"{p} top-{default.top_k(p)}" for p in default.pathways)
        + " (union; bm25 and summary at their defaults)"
    )
    data = args.data / f"sweep-q{args.questions}"
    if not (data / "sweep.json").exists():
        t0 = time.perf_counter()
        build_sweep(SweepConfig(questions=args.questions, lengths=LENGTHS, overwrite=True), data)
        print(f"sweep built in {time.perf_counter() - t0:.0f} s: {data}")
    tok = load_tokenizer(None)
    sweep_k = [int(k) for k in args.top_k.split(",")]
    tested = settings_under_test(default)
    rows = []
    headline = {}
    for length in LENGTHS:
        ds = load_built(data / f"length-{length:05d}")
        tallies = {(name, qs): Tally() for name in tested for qs in ("question", "two-hop")}
        sweep_tallies = {(k, qs): Tally() for k in sweep_k for qs in ("question", "two-hop")}
        latencies: list[float] = []
        builds: list[float] = []
        chunks_n: list[int] = []
        tokens: list[int] = []
        for row in ds:
            chunks = chunk_context(row["context"], tok, args.chunk_tokens, row["doc_offsets"])
            gold_docs = set(row["gold_documents"])
            gold = {c.index for c in chunks if set(c.documents) & gold_docs}
            chunks_n.append(len(chunks))
            tokens.append(row["num_tokens"])
            top = max([*sweep_k, default.bm25_top_k, default.summary_top_k])
            t0 = time.perf_counter()
            router = ChunkRouter([c.text for c in chunks], replace(default, bm25_top_k=top, summary_top_k=top))
            builds.append(time.perf_counter() - t0)
            if router.dense_error:  # figures without the pathway asked for would mislead
                raise SystemExit(f"dense pathway unavailable: {router.dense_error}")
            query_sets = {
                "question": [row["question"]],
                "two-hop": two_hop_queries(row["question"], row["gold_titles"]),
            }
            for qs, queries in query_sets.items():
                for name, s in tested.items():
                    routes = []
                    for q in queries:
                        t0 = time.perf_counter()
                        routes.append(router.route(q, s).chunks)
                        if name == "union (default)":
                            latencies.append(time.perf_counter() - t0)
                    tallies[(name, qs)].add(routes, len(chunks), gold)
                if length == LENGTHS[-1]:
                    for k in sweep_k:
                        s = replace(default, bm25_top_k=k, summary_top_k=k)
                        sweep_tallies[(k, qs)].add([router.route(q, s).chunks for q in queries], len(chunks), gold)
        n_chunks = statistics.fmean(chunks_n)
        for (name, qs), t in tallies.items():
            queries = t.broadcast_calls / n_chunks if n_chunks else 0
            rows.append(
                (length, statistics.fmean(tokens), n_chunks, qs, name, t.routed_calls / queries, t.reduction, t.recall)
            )
        ms = [1000 * x for x in latencies]
        print(
            f"{length:>5,} paragraphs: {len(ds)} questions, {statistics.fmean(tokens):,.0f} tokens, {n_chunks:.1f} chunks; "
            f"router {statistics.fmean(ms):.2f} ms mean / {nearest_rank_percentile(ms, 95):.2f} ms p95 per query "
            f"(index cached; built in {statistics.fmean(builds):.2f} s per document)"
        )
        if length == LENGTHS[-1]:
            headline = {
                "tallies": tallies,
                "sweep": sweep_tallies,
                "ms": ms,
                "tokens": statistics.fmean(tokens),
                "chunks": n_chunks,
            }

    print(
        "\n| paragraphs | tokens (mean) | chunks | queries | pathways | reader calls / query | reduction vs broadcast | gold-chunk recall |"
    )
    print("|---:|---:|---:|---|---|---:|---:|---:|")
    for length, tokens_mean, n_chunks, qs, name, calls, reduction, recall in rows:
        print(
            f"| {length:,} | {tokens_mean:,.0f} | {n_chunks:.1f} | {qs} | {name} | {calls:.1f} | {reduction:.1f}x | {recall:.3f} |"
        )
    print(f"\ntop-k sweep at {LENGTHS[-1]:,} paragraphs (union, same k for both pathways):")
    print("| top-k per pathway | queries | reader calls / query | reduction | gold-chunk recall |")
    print("|---:|---|---:|---:|---:|")
    for (k, qs), t in headline["sweep"].items():
        queries = t.broadcast_calls / headline["chunks"]
        print(f"| {k} | {qs} | {t.routed_calls / queries:.1f} | {t.reduction:.1f}x | {t.recall:.3f} |")

    union = headline["tallies"][("union (default)", "two-hop")]
    question = headline["tallies"][("union (default)", "question")]
    ms = headline["ms"]
    mean_ms, p95_ms = statistics.fmean(ms), nearest_rank_percentile(ms, 95)
    print(
        f"\nat {LENGTHS[-1]:,} paragraphs ({headline['tokens']:,.0f} tokens), default routed setting, two-hop queries:"
    )
    print(f"reduction: {union.reduction:.1f}")
    print(f"recall: {union.recall:.3f}")
    print(f"latency: {mean_ms:.2f} ms mean, {p95_ms:.2f} ms p95 per query")
    print(f"question text only: reduction {question.reduction:.1f}, recall {question.recall:.3f}")
    met = union.reduction >= 10 and union.recall >= 0.95 and p95_ms <= 20
    print(f"target (>= 10x at recall >= 0.95, <= 20 ms per query): {'met' if met else 'NOT met'} (two-hop queries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
