"""Run under `accelerate launch --cpu --num_processes 2`: rank 0's rollouts need 3 tool rounds,
rank 1's need 1. Every generation call holds an all-reduce, as vLLM server mode or ZeRO-3 would;
without lock-step the ranks would hang. Writes per-rank counters for the test to compare."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from coordrl.testing import scripted_trainer_class
from coordrl.train.config import load_config
from coordrl.train.run import build_trainer
from coordrl.train.trainer import CoordGRPOTrainer

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
collectives = 0

Scripted = scripted_trainer_class(CoordGRPOTrainer, rounds=lambda r: 3 if r == 0 else 1)


class CollectiveGeneration(Scripted):
    def _backend_generate(self, *args, **kwargs):
        global collectives
        t = torch.ones(1)
        dist.all_reduce(t)  # what a vLLM server-mode / ZeRO-3 generation call does on every rank
        collectives += 1
        return super()._backend_generate(*args, **kwargs)


root = Path(__file__).resolve().parents[2]
cfg = load_config(
    root / "configs" / "tiny_cpu.yaml",
    {
        "output_dir": str(out / "run"),
        "max_steps": "2",
        "eval_strategy": "no",
        "eval_data": "null",
        "report_to": "none",
        "save_strategy": "no",
        "traces": "false",
        "per_device_train_batch_size": "2",
        "num_generations": "4",
        **({"lockstep": "false"} if os.environ.get("LOCKSTEP_OFF") else {}),
    },
)
trainer = build_trainer(cfg, trainer_cls=CollectiveGeneration)
trainer.train()
(out / f"rank{rank}.json").write_text(json.dumps({"collectives": collectives, "stats": trainer.tool_loop_stats}))
