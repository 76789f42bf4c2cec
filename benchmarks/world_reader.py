"""Held-out figures of the kept world reader (``coordrl/resources/world_reader``).

The prompts are `coordrl.data.world_reader.eval_examples` of the world's held-out questions (chains
never seen in training): for every chunk, every positive (the chunk holds the asked fact), every
``hard`` negative (the entity is in the chunk, the asked fact is not), two ``row`` negatives (an
entity of the same question, document elsewhere), one ``wrong_type`` and one ``absent`` negative.
Replies are greedy, through exactly the reader prompt the fleet sends (``reader_messages`` and the
model's chat template). Printed:

* ``positive exact``: the reply equals the target ``"<title>: <sentence>"`` character for character
  (the lexical reader's answer for the same prompt); ``positive names value``: the reply is not
  ``Unknown`` and contains the asked director/city/decade as a whole word (looser);
* ``negative answered``: the reply is anything but exactly ``Unknown``, overall and per kind;
* ``target:`` positive exact >= 0.97 and negative answered <= 0.03.

``--vllm`` also serves the model with vLLM's CPU build (``.venv-vllm``, as ``coordrl serve-readers
--cpu`` does), asks the first ``--vllm-rows`` questions' prompts through `OpenAIReaderFleet`, prints the
same figures, the share of replies identical to transformers' and the prefix-cache hit rate.
``--vllm-block-sizes 128 32`` serves the same prompts once per KV-cache block size (``--block-size``;
vLLM's CPU build defaults to 128, ``coordrl serve-readers --cpu`` passes 32) and prints each run's
seconds and hit rate, and the time ratio: a prefix is cached only in whole blocks, so the block size
decides how much of a ~240-token reader prompt can hit.

The chunks are cut as the model was built to read them (its recipe's ``docs_per_chunk``; the kept
reader: one whole document per chunk, ``world_docs_per_chunk: 1`` in training); ``--docs-per-chunk 2``
asks about the same questions cut into the world's default two-document chunks, where a chunk can
hold two facts of one relation.

    .venv/bin/python benchmarks/world_reader.py [--rows 200] [--docs-per-chunk N] [--vllm] [--vllm-rows 40]
        [--vllm-block-sizes 128 32] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

TARGET_EXACT = 0.97
TARGET_ANSWERED = 0.03


def builder():
    """``scripts/build_world_reader.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_world_reader", REPO / "scripts" / "build_world_reader.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def show(label: str, figures: dict) -> bool:
    print(
        f"{label}: positive exact {figures['positive_exact']:.4f} (names value {figures['positive_names_value']:.4f}; n={figures['n_positive']})"
    )
    if "positive_exact_contrast" in figures:
        print(
            f"{label}: positive exact on chunks with two facts of the asked relation "
            f"{figures['positive_exact_contrast']:.4f} (n={figures['n_positive_contrast']}), "
            f"on the others {figures.get('positive_exact_single', float('nan')):.4f} (n={figures.get('n_positive_single', 0)})"
        )
    kinds = ", ".join(
        f"{k} {figures[f'answered_{k}']:.4f} (n={figures[f'n_{k}']})"
        for k in ("hard", "row", "absent", "wrong_type")
        if f"answered_{k}" in figures
    )
    print(f"{label}: negative answered {figures['negative_answered']:.4f} (n={figures['n_negative']}; {kinds})")
    ok = figures["positive_exact"] >= TARGET_EXACT and figures["negative_answered"] <= TARGET_ANSWERED
    print(
        f"{label}: target: positive exact >= {TARGET_EXACT} and negative answered <= {TARGET_ANSWERED}: {'MET' if ok else 'NOT MET'}"
    )
    return ok


def vllm_replies(
    model_dir: Path, examples, python: str | None, block_size: int | None = None
) -> tuple[list[str], float, float]:
    """Replies through a vLLM CPU server (KV-cache blocks of ``block_size`` tokens; None: serve.py's CPU default)
    and the fleet; returns (replies, seconds, prefix-cache hit rate)."""
    from coordrl.readers.base import ReaderRequest, chunk_key
    from coordrl.readers.openai_fleet import OpenAIReaderFleet
    from coordrl.readers.serve import prefix_cache_counters, start_reader_servers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = ["--enforce-eager"] + ([] if block_size is None else ["--block-size", str(block_size)])
    group = start_reader_servers(str(model_dir), cpu=True, port_base=port, python=python, max_model_len=1024, cpu_memory_fraction=0.15,
                                 extra_args=extra, startup_timeout_s=600)  # fmt: skip
    with group:
        url = group.urls[0]
        fleet = OpenAIReaderFleet([url], str(model_dir), api_key_env=None, max_tokens=48, max_concurrency=32)
        requests = [ReaderRequest(e.query, e.chunk, chunk_key(e.chunk)) for e in examples]

        async def run():
            try:
                return await fleet.answer(requests)
            finally:
                await fleet.aclose()

        q0, h0 = prefix_cache_counters(url)
        t0 = time.perf_counter()
        results = asyncio.run(run())
        seconds = time.perf_counter() - t0
        q1, h1 = prefix_cache_counters(url)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} vLLM requests failed, e.g. {failed[0]}")
    return [r.text.strip() for r in results], seconds, (h1 - h0) / max(q1 - q0, 1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the kept coordrl/resources/world_reader)")
    p.add_argument(
        "--rows", type=int, default=200, help="held-out world questions whose chunks are asked (default 200, all)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--docs-per-chunk",
        type=int,
        default=None,
        help="whole documents per reader chunk (default: the chunking the model was built for, its recipe's docs_per_chunk)",
    )
    p.add_argument("--vllm", action="store_true", help="also measure through a vLLM CPU server (needs .venv-vllm)")
    p.add_argument("--vllm-rows", type=int, default=40, help="held-out questions asked through vLLM (default 40)")
    p.add_argument("--vllm-python", default=None, help="interpreter with vllm (default .venv-vllm/bin/python)")
    p.add_argument(
        "--vllm-block-sizes",
        type=int,
        nargs="+",
        default=None,
        help="serve once per KV-cache block size and compare (default: one server at coordrl serve-readers' CPU block size)",
    )
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coordrl.data.world import make_world, world_splits
    from coordrl.data.world_reader import (
        META_NAME,
        built_docs_per_chunk,
        eval_examples,
        score_replies,
        world_reader_dir,
    )

    model_dir = Path(a.model) if a.model else world_reader_dir()
    meta_path = model_dir / META_NAME
    if not meta_path.is_file():
        print(
            f"world_reader: no {meta_path.name} in {model_dir}; build it with scripts/build_world_reader.py",
            file=sys.stderr,
        )
        return 2
    meta = json.loads(meta_path.read_text())
    n_heldout = meta["recipe"]["n_heldout"]
    if not 1 <= a.rows <= n_heldout:
        print(f"world_reader: --rows must be in 1..{n_heldout}, got {a.rows}", file=sys.stderr)
        return 2
    if a.docs_per_chunk is None:
        a.docs_per_chunk = built_docs_per_chunk(model_dir)
    if a.docs_per_chunk < 1:
        print(f"world_reader: --docs-per-chunk must be >= 1, got {a.docs_per_chunk}", file=sys.stderr)
        return 2
    if a.vllm and not 1 <= a.vllm_rows <= a.rows:
        print(f"world_reader: --vllm-rows must be in 1..--rows ({a.rows}), got {a.vllm_rows}", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    build = builder()
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), use_safetensors=True, dtype=torch.float32, local_files_only=True
    )
    world = make_world(0)
    heldout = world_splits(meta["recipe"]["n_train"], n_heldout, seed=0, docs_per_chunk=a.docs_per_chunk)["heldout"]
    examples = eval_examples(heldout[: a.rows], world)
    print(
        f"world reader {model_dir} ({sum(f.stat().st_size for f in model_dir.iterdir()) / 1e6:.1f} MB); {a.rows} held-out questions, {a.docs_per_chunk} document(s) per chunk, {len(examples)} prompts"
    )
    t0 = time.perf_counter()
    replies = build.greedy_replies(model, tok, examples)
    print(f"transformers greedy: {len(examples)} prompts in {time.perf_counter() - t0:.1f}s ({a.threads} threads)")
    ok = show("transformers", score_replies(examples, replies))
    wrong = [(e, r) for e, r in zip(examples, replies, strict=True) if r != e.answer][:3]
    for e, r in wrong:
        print(f"  e.g. [{e.kind}] {e.query!r} -> {r!r} (want {e.answer!r})")
    if a.vllm:
        sub = eval_examples(heldout[: a.vllm_rows], world)
        seconds_by_block = {}
        for block_size in a.vllm_block_sizes or [None]:
            served, seconds, hit_rate = vllm_replies(model_dir, sub, a.vllm_python, block_size)
            seconds_by_block[block_size] = seconds
            blocks = "coordrl serve-readers' CPU block size" if block_size is None else f"--block-size {block_size}"
            print(
                f"vllm ({blocks}): {len(sub)} prompts in {seconds:.1f}s through OpenAIReaderFleet; prefix-cache hit rate {hit_rate:.3f}"
            )
            ok = show("vllm", score_replies(sub, served)) and ok
            same = sum(s == r for s, r in zip(served, replies[: len(sub)], strict=True)) / len(sub)
            print(f"vllm vs transformers: {same:.4f} of replies identical")
        if len(seconds_by_block) > 1:
            first, *rest = seconds_by_block.items()
            for block_size, seconds in rest:
                print(f"vllm time, --block-size {first[0]} over --block-size {block_size}: {first[1] / seconds:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
