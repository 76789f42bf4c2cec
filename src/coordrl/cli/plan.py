"""``python -m coordrl.cli.plan CONFIG``: print a training run's plan (layout, batch, budget, memory)
without starting it; exit 2 when the plan cannot work. ``coordrl train --dry-run`` prints the same."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coordrl.train.config import ConfigError, load_config, parse_overrides
from coordrl.train.plan import PlanError, format_plan, make_plan

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m coordrl.cli.plan CONFIG [plan flags] [--field VALUE ...]``; exit 2 when it cannot work."""
    parser = argparse.ArgumentParser(
        prog="python -m coordrl.cli.plan", description="print a training run's plan without starting it"
    )
    parser.add_argument("config", type=Path)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--num-processes", type=int, default=None)
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, parse_overrides(rest))
        plan = make_plan(cfg, num_processes=args.num_processes, gpus_per_node=args.gpus_per_node,
                         num_nodes=args.num_nodes, gpu_memory_gb=args.gpu_memory_gb, check=False)  # fmt: skip
    except (ConfigError, PlanError) as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if plan.errors:
        print("plan: error: " + "; ".join(plan.errors), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
