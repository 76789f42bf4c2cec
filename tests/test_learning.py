"""The reduced learning check (issue 7): GRPO through `coordrl train` must make the kept warm start better.

From the kept warm start (`coordrl:world-warm-start`), ``STEPS`` GRPO steps of ``configs/world_cpu.yaml``
(the code path of every real run: TRL GRPOTrainer, the PARSER environment, lexical readers,
concurrent tools, masked observations), then held-out exact match, sampled at temperature 1, on
``N_EVAL`` questions whose chains never occur in training.

Threshold: ``MIN_GAIN`` points of sampled held-out exact match. Measured with this exact setup on
the 2-core machine (``benchmarks/learning_check.py --reuse-warm-start --minutes 0 --steps 30``
style runs, seeds 0/1/2; see README "Learning check"): gains of GAINS_MEASURED points. The
threshold sits far below the smallest of them yet far above the evaluation noise of the untrained
policy (two evaluations of the same warm start with different sampling seeds differ by a few points
on N_EVAL questions), so a broken mask, reward or tool loop fails it while seed luck does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordrl.data.world import evaluate_world, world_splits
from coordrl.train.config import load_config
from coordrl.train.run import WORLD_MODEL, resolve_model, train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "world_cpu.yaml"
STEPS = 40
N_EVAL = 60
MIN_GAIN = 20.0


def _sampled_em(path: str, rows: list[dict]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32)
    return evaluate_world(model, tok, rows, sample=True, seed=0)


@pytest.mark.slow
def test_grpo_from_the_kept_warm_start_raises_heldout_exact_match(tmp_path):
    rows = world_splits(0, N_EVAL, seed=0)["heldout"]
    before = _sampled_em(resolve_model(WORLD_MODEL), rows)
    cfg = load_config(CONFIG, {"output_dir": str(tmp_path / "run"), "max_steps": str(STEPS), "max_train_minutes": "4", "seed": "0"})
    train(cfg)
    after = _sampled_em(str(tmp_path / "run" / "final"), rows)
    gain = 100 * (after["all"] - before["all"])
    print(f"held-out sampled EM {100 * before['all']:.0f}% -> {100 * after['all']:.0f}% (gain {gain:+.0f} points)")
    assert gain >= MIN_GAIN, (before, after)
