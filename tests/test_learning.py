"""The reduced learning check: GRPO through `coordrl train` must make the kept warm start better.

From the kept warm start (`coordrl:world-warm-start`), ``STEPS`` GRPO optimizer steps of ``configs/world_cpu.yaml``
(the code path of every real run: TRL GRPOTrainer, the PARSER environment, lexical readers,
concurrent tools, masked observations), then held-out exact match, sampled at temperature 1, on
``N_EVAL`` questions whose chains never occur in training.

Threshold: ``MIN_GAIN`` = 30 points of sampled held-out exact match. Measured with exactly this
setup and the current recipe (cosine rate to 1.4e-4 over the run's steps after 10 warm-up steps, KL
0.04; the kept warm start with episode-layout comparison drills) on 2 AVX512-BF16 EPYC cores (bf16
autocast): 33% -> 87% (+53) after 30 steps, and 33% -> 82% (+48) in fp32 (`bf16: false`, what CPUs without native
bf16 run); 20 steps gave only +28, since the schedule then spends
half the run warming up and the rest decaying, so the test runs 30. The earlier recipe (constant 1e-4,
no KL) on a 2-core AVX2-only EPYC (fp32), one 40-step run evaluated every 10 steps: 32% -> 68% (10
steps), 90% (20), 82% (30), 95% (40). Noise without learning: the same warm start evaluated with
different sampling seeds moves by up to 10 points on 60 questions. So 30 is 23 points below the
measured gain and 3 times the noise: a broken loss mask, reward, tool loop or config fails it; seed
luck does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordrl.data.world import world_splits
from coordrl.rollout.models import WORLD_MODEL, resolve_model
from coordrl.rollout.world import evaluate_world
from coordrl.train.config import load_config
from coordrl.train.run import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "world_cpu.yaml"
STEPS = 30
N_EVAL = 60
MIN_GAIN = 30.0


def _sampled_em(path: str, rows: list[dict]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32)
    return evaluate_world(model, tok, rows, sample=True, seed=0)


@pytest.mark.slow
def test_grpo_from_the_kept_warm_start_raises_heldout_exact_match(tmp_path):
    rows = world_splits(0, N_EVAL, seed=0)["heldout"]
    before = _sampled_em(resolve_model(WORLD_MODEL), rows)
    cfg = load_config(CONFIG, {"output_dir": str(tmp_path / "run"), "max_steps": str(STEPS), "seed": "0"})
    train(cfg)
    after = _sampled_em(str(tmp_path / "run" / "final"), rows)
    gain = 100 * (after["all"] - before["all"])
    print(f"held-out sampled EM {100 * before['all']:.0f}% -> {100 * after['all']:.0f}% (gain {gain:+.0f} points)")
    assert gain >= MIN_GAIN, (before, after)
