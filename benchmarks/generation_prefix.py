"""The tool loop's generation calls with the prefixes their rows share forwarded once, against TRL's own call.

The calls are the PARSER world's as ``coordrl train --config configs/world_cpu.yaml`` makes them with
transformers generation, or with ``--world hmars`` the HMARS world's (``configs/hmars_world_cpu.yaml``,
its kept warm start, scripted ``good`` / ``first_hop`` broadcasts,
`coordrl.rollout.hmars_world.hmars_demo_ids`): 16 rows (8 rollouts of each of 2 training questions) of
the kept warm start, each rendered exactly as TRL renders a rollout (`coordrl.rollout.world.demo_ids`:
the prompt with TRL's template, then each assistant turn and tool round). Call 1 gets the prompts; call 2
the rows of the rollouts that called the tool, grown by their first turn and its tool result. Each call
is run left-padded as TRL runs it (``model.generate``, sampled at temperature 1, 48 new tokens) with
``share_generation_prefix`` off and on (`coordrl.train.trainer._common_prefix_generate`), same weights,
threads and sampling seed. Prints prefill tokens, seconds per call (median of ``--repeats``), the ratio,
and whether the sampled completions are identical.

    python benchmarks/generation_prefix.py [--world parser|hmars] [--threads 2] [--repeats 3] [--questions 2]
        [--generations 8]

Target: both calls together at least 1.5x faster, the same completions.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from bench_setup import batch_parser, load_policy
from transformers import GenerationConfig

from coordrl.data.hmars_world import hmars_world_splits
from coordrl.data.world import world_splits
from coordrl.envs.chat import ChatCodec
from coordrl.rollout.hmars_world import hmars_demo_ids, make_hmars_env_factory
from coordrl.rollout.world import demo_ids, make_env_factory
from coordrl.train.trainer import _common_prefix_generate, new_prefix_stats


def turn_rows(tok, world: str, questions: int, generations: int) -> list[list[list[int]]]:
    """Per generation call of the tool loop, its rows: every rollout's ids up to the start of that
    assistant turn (rollouts that end earlier drop out, as in TRL's loop)."""
    codec = ChatCodec(tok)
    if world == "hmars":
        factory = make_hmars_env_factory(tok)
        rows = hmars_world_splits(questions, 1, seed=0, tokenizer=tok)["train"]

        def episode(row, g):
            return hmars_demo_ids(row, "good" if g % 2 == 0 else "first_hop", codec, factory)
    else:
        factory = make_env_factory(tok)
        rows = world_splits(questions, 1, seed=0)["train"]

        def episode(row, g):
            return demo_ids(row, g % 2 == 0, codec, factory)

    try:
        episodes = [episode(row, g) for row in rows for g in range(generations)]
    finally:
        factory.close()
    calls: list[list[list[int]]] = []
    for turn in range(2):
        rows_of_turn = []
        for ids, mask in episodes:
            starts = [i for i in range(len(mask)) if mask[i] == 1 and (i == 0 or mask[i - 1] == 0)]
            if turn < len(starts):
                rows_of_turn.append(ids[: starts[turn]])
        calls.append(rows_of_turn)
    return calls


def main() -> None:
    p = batch_parser(__doc__)
    p.add_argument("--world", choices=("parser", "hmars"), default="parser")
    a = p.parse_args()
    tok, model = load_policy("hmars_warm_start" if a.world == "hmars" else "warm_start", a.threads)
    model.eval()
    pad = tok.pad_token_id
    config = GenerationConfig(
        max_new_tokens=48,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_token_id=pad,
        eos_token_id=tok.eos_token_id,
    )

    def generate(rows: list[list[int]], shared: bool, stats: dict) -> tuple[float, list[list[int]]]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.no_grad(), _common_prefix_generate(model, stats) if shared else contextlib.nullcontext():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return time.perf_counter() - t0, out[:, width:].tolist()

    calls = turn_rows(tok, a.world, a.questions, a.generations)
    total = {False: 0.0, True: 0.0}
    same = True
    for k, rows in enumerate(calls, start=1):
        times: dict[bool, list[float]] = {False: [], True: []}
        outs = {}
        stats = new_prefix_stats()
        for _ in range(a.repeats):
            for shared in (False, True):
                seconds, outs[shared] = generate(rows, shared, stats)
                times[shared].append(seconds)
        t_plain, t_shared = statistics.median(times[False]), statistics.median(times[True])
        total[False] += t_plain
        total[True] += t_shared
        same &= outs[False] == outs[True]
        per = a.repeats
        print(
            f"call {k}: {len(rows)} rows of {min(map(len, rows))}-{max(map(len, rows))} tokens; prefill "
            f"TRL {stats['generation_prefill_plain'] // per:,}, shared {stats['generation_prefill'] // per:,} tokens; "
            f"TRL {t_plain:.2f} s, shared {t_shared:.2f} s ({t_plain / t_shared:.2f}x); "
            f"completions identical: {outs[False] == outs[True]}"
        )
    ratio = total[False] / total[True]
    print(f"both calls: TRL {total[False]:.2f} s, shared {total[True]:.2f} s: {ratio:.2f}x ({a.threads} threads)")
    print(f"target (>= 1.5x, the same completions): {'MET' if ratio >= 1.5 and same else 'NOT MET'}")


if __name__ == "__main__":
    main()
