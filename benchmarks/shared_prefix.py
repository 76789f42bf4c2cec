"""GRPO's scoring pass with the prompt shared across a group's rollouts, against TRL's own pass.

The batch is the HMARS world's as ``configs/hmars_world_cpu.yaml`` trains it: 16 rollouts, 8 per
prompt, of the kept HMARS warm start, each a scripted episode rendered exactly as TRL renders one
(the mid-agent prompt with its regional memory, the ``broadcast`` call, the tool result, the answer
turn); the rollouts of a prompt differ in their broadcast (good, first hop only, misrouted,
interpretation only). ``CoordGRPOTrainer._get_per_token_logps_and_entropies`` scores it with
``share_prompt_prefix`` off (TRL's pass) and on, forward and backward as in a training step, on the
same weights and threads. Prints tokens forwarded, seconds per pass (median of ``--repeats``), the
ratio, and the largest log-prob and gradient differences between the two.

    python benchmarks/shared_prefix.py [--threads 2] [--repeats 3] [--questions 2] [--generations 8]

Target: the shared pass at least 2x faster on the HMARS world batch, log-probs within 1e-4.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from accelerate import Accelerator
from bench_setup import batch_parser, load_policy
from trl.trainer.utils import add_fused_lm_head

from coordrl.data.hmars_world import hmars_world_splits
from coordrl.envs.chat import ChatCodec
from coordrl.rollout.hmars_world import hmars_demo_ids, make_hmars_env_factory
from coordrl.train.trainer import CoordGRPOTrainer, new_prefix_stats

KINDS = ("good", "first_hop", "misrouted", "interpretation_only")


def rollouts(tok, questions: int, generations: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, completion width)`` laid out as TRL lays out a scoring batch:
    left-padded prompts, then right-padded completions."""
    codec = ChatCodec(tok)
    factory = make_hmars_env_factory(tok)
    try:
        rows = hmars_world_splits(questions, 1, seed=0, tokenizer=tok)["train"]
        episodes = [
            hmars_demo_ids(row, KINDS[g % len(KINDS)], codec, factory) for row in rows for g in range(generations)
        ]
    finally:
        factory.close()
    split = [(ids[: mask.index(1)], ids[mask.index(1) :]) for ids, mask in episodes]
    p = max(len(a) for a, _ in split)
    c = max(len(b) for _, b in split)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (p - len(a)) + a + b + [pad] * (c - len(b)) for a, b in split])
    mask = torch.tensor([[0] * (p - len(a)) + [1] * (len(a) + len(b)) + [0] * (c - len(b)) for a, b in split])
    return ids, mask, c


def main() -> None:
    a = batch_parser(__doc__).parse_args()
    tok, model = load_policy("hmars_warm_start", a.threads)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask, comp = rollouts(tok, a.questions, a.generations)
    live = mask[:, -comp:].bool()

    # The scoring pass alone needs none of the trainer's state but these (no dataset, no environment).
    trainer = CoordGRPOTrainer.__new__(CoordGRPOTrainer)
    trainer.accelerator = Accelerator(cpu=True)
    trainer.prefix_stats = new_prefix_stats()

    def score(shared: bool) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
        trainer.share_prompt_prefix = shared
        model.zero_grad()
        t0 = time.perf_counter()
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, comp, compute_entropy=True)
        (logps * live).sum().backward()
        seconds = time.perf_counter() - t0
        return seconds, logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    times = {False: [], True: []}
    for _ in range(a.repeats):
        for shared in (False, True):
            seconds, *_ = score(shared)
            times[shared].append(seconds)
    _, plain_logps, plain_grads = score(False)
    _, logps, grads = score(True)
    dlogp = (logps - plain_logps)[live].abs().max().item()
    dgrad = max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in plain_grads.items())

    b, width = ids.shape
    prompt = width - comp
    forwarded = a.questions * (prompt - 1) + b * (comp + 1)
    print(
        f"batch: {b} rollouts of {a.questions} prompts, {prompt} prompt + {comp} completion tokens (padded), {a.threads} threads"
    )
    print(f"tokens forwarded: TRL {ids.numel():,}, shared {forwarded:,} ({ids.numel() / forwarded:.1f}x fewer)")
    t_plain, t_shared = statistics.median(times[False]), statistics.median(times[True])
    print(f"forward + backward: TRL {t_plain:.2f} s, shared {t_shared:.2f} s (median of {a.repeats})")
    print(f"speed-up: {t_plain / t_shared:.2f}x")
    print(f"largest difference: log-prob {dlogp:.2e}, gradient {dgrad:.2e} (relative to the tensor's largest entry)")
    met = t_plain / t_shared >= 2 and dlogp <= 1e-4
    print(f"target (>= 2x, log-probs within 1e-4): {'MET' if met else 'NOT MET'}")


if __name__ == "__main__":
    main()
