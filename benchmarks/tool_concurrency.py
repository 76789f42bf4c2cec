"""Tool-loop time of stock TRL 1.16 (serial across rollouts) against coordrl's concurrent rounds.

Same workload, one run, side by side: 16 rollouts per step x 3 tool rounds x 2 steps, every reader
call taking 0.2 s (a latency-injecting fake fleet over the lexical reader), the tiny local policy
with scripted tool calls (so both runs make exactly the same calls). Target: coordrl's tool
overhead <= 1.5 x rounds x steps x 0.2 s = 1.8 s, i.e. >= 5x faster than stock.

    python benchmarks/tool_concurrency.py [--latency 0.2] [--rollouts 16] [--rounds 3] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from coordrl.testing import LatencyInjectingFleet, scripted_trainer_class
from coordrl.train.config import load_config
from coordrl.train.run import build_trainer
from coordrl.train.trainer import CoordGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]


def run(concurrent: bool, args, out: Path) -> tuple[float, float, int]:
    class Timed(scripted_trainer_class(CoordGRPOTrainer, rounds=args.rounds)):
        tool_seconds = 0.0

        def _tool_call_loop(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._tool_call_loop(*a, **k)
            finally:
                Timed.tool_seconds += time.perf_counter() - t0

    fleet = LatencyInjectingFleet(args.latency)
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.yaml",
        {
            "output_dir": str(out / ("coordrl" if concurrent else "stock")),
            "max_steps": args.steps,
            "per_device_train_batch_size": args.rollouts,
            "num_generations": 4,
            "max_turns": args.rounds,
            "tool_concurrency": concurrent,
            "eval_strategy": "no",
            "eval_data": None,
            "save_strategy": "no",
            "report_to": "none",
            "traces": False,
            "max_completion_length": 2048,
        },
    )
    trainer = build_trainer(cfg, trainer_cls=Timed, fleet=fleet)
    t0 = time.perf_counter()
    trainer.train()
    return Timed.tool_seconds, time.perf_counter() - t0, fleet.batches


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stock_tools, stock_wall, stock_calls = run(False, args, Path(tmp))
        ours_tools, ours_wall, ours_calls = run(True, args, Path(tmp))
    bound = 1.5 * args.rounds * args.steps * args.latency
    print(
        f"machine: {os.cpu_count()} cores; workload: {args.rollouts} rollouts x {args.rounds} rounds x {args.steps} steps, reader latency {args.latency} s"
    )
    print(f"stock TRL tool loop:  {stock_tools:.2f} s ({stock_calls} tool calls; run {stock_wall:.1f} s)")
    print(
        f"coordrl tool loop:    {ours_tools:.2f} s ({ours_calls} tool calls; run {ours_wall:.1f} s); target <= {bound:.2f} s"
    )
    print(f"speedup: {stock_tools / ours_tools:.1f}")
    return 0 if stock_calls == ours_calls else 1


if __name__ == "__main__":
    sys.exit(main())
