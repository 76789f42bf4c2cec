"""Does coordrl's GRPO loop make a policy learn? The CPU learning check of issue 7.

1. Rebuild the world warm start (``scripts/build_warm_start.py``; ``--reuse-warm-start`` takes the kept
   one in ``src/coordrl/resources/warm_start``).
2. For each seed: GRPO through `coordrl.train.run.train` with ``configs/world_cpu.yaml`` (the same code
   path as ``coordrl train``), at most ``--minutes`` of steps.
3. Held-out exact match (sampled at temperature 1 and greedy) per question type before and after,
   ``gain: <points>`` (sampled, mean over seeds, with the spread), the reward curve as a PNG, wall times.

Target (issue 7): after <= 5 minutes of GRPO on 2 cores, sampled >= 90% and greedy >= 95% on both
question types, for every seed. Targets are printed next to the results, never adjusted.

    python benchmarks/learning_check.py [--reuse-warm-start] [--seeds 0 1 2] [--minutes 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "src" / "coordrl" / "resources" / "warm_start"
CONFIG = ROOT / "configs" / "world_cpu.yaml"
TARGET_SAMPLED, TARGET_GREEDY = 0.90, 0.95


def evaluate(path: str | Path, rows: list[dict], seed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coordrl.data.world import evaluate_world

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, dtype=torch.float32)
    return {"sampled": evaluate_world(model, tok, rows, sample=True, seed=seed), "greedy": evaluate_world(model, tok, rows, sample=False, seed=seed)}


def grpo(seed: int, minutes: float, out: Path, warm: Path, overrides: dict[str, str]) -> tuple[Path, list[dict], float]:
    from coordrl.train.config import load_config
    from coordrl.train.run import train
    from coordrl.train.trainer import CoordGRPOTrainer

    seen: list = []

    class Recording(CoordGRPOTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)

    cfg = load_config(CONFIG, {"model": str(warm), "seed": str(seed), "output_dir": str(out), "max_train_minutes": str(minutes), **overrides})
    t0 = time.time()
    train(cfg, trainer_cls=Recording)
    history = [h for h in seen[0].state.log_history if "reward" in h]
    return out / "final", history, time.time() - t0


def fmt(ev: dict) -> str:
    return "  ".join(f"{k} {100 * ev[k]:5.1f}%" for k in ("bridge", "comparison", "all"))


def plot(curves: dict[int, list[dict]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: reward curve PNG skipped (the curve is in learning_check.json)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for seed, hist in curves.items():
        ax.plot([h["step"] for h in hist], [h["reward"] for h in hist], label=f"seed {seed}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("training reward (exact match)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"reward curve: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reuse-warm-start", action="store_true", help="start from the kept checkpoint instead of rebuilding it")
    p.add_argument("--warm-start", default=None, help="start from this warm-start folder instead of rebuilding it")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--minutes", type=float, default=5.0, help="GRPO wall-clock budget per seed")
    p.add_argument("--eval-n", type=int, default=100, help="held-out questions evaluated (half per type)")
    p.add_argument("--out", default="runs/learning_check")
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 is much faster when another job shares the cores)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="config overrides, e.g. learning_rate=1e-5 tool_concurrency=false")
    a = p.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = dict(kv.split("=", 1) for kv in a.set)
    walls: dict[str, float] = {}
    t0 = time.time()
    warm = Path(a.warm_start) if a.warm_start else KEPT
    if not (a.reuse_warm_start or a.warm_start):
        spec = importlib.util.spec_from_file_location("build_warm_start", ROOT / "scripts" / "build_warm_start.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        warm = out / "warm_start"
        mod.build(warm, seed=0, batch=16, threads=a.threads)
        walls["warm_start_s"] = time.time() - t0

    from coordrl.data.world import world_splits

    rows = world_splits(0, a.eval_n, seed=0)["heldout"]
    results: dict = {"seeds": {}, "target": {"sampled": TARGET_SAMPLED, "greedy": TARGET_GREEDY}}
    curves: dict[int, list[dict]] = {}
    for seed in a.seeds:
        t = time.time()
        before = evaluate(warm, rows, seed)
        final, hist, train_s = grpo(seed, a.minutes, out / f"seed{seed}", warm, overrides)
        after = evaluate(final, rows, seed)
        curves[seed] = hist
        results["seeds"][seed] = {"before": before, "after": after, "grpo_s": train_s, "steps": len(hist), "curve": [{"step": h["step"], "reward": h["reward"]} for h in hist], "seed_s": time.time() - t}
        print(f"seed {seed}: {len(hist)} GRPO steps in {train_s:.0f}s")
        print(f"  before  sampled {fmt(before['sampled'])} | greedy {fmt(before['greedy'])}")
        print(f"  after   sampled {fmt(after['sampled'])} | greedy {fmt(after['greedy'])}", flush=True)
    gains = [100 * (r["after"]["sampled"]["all"] - r["before"]["sampled"]["all"]) for r in results["seeds"].values()]
    spread = (max(gains) - min(gains)) / 2 if len(gains) > 1 else 0.0
    sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    results["gain_points"] = {"mean": statistics.mean(gains), "per_seed": gains, "half_range": spread, "stdev": sd}
    met = all(
        r["after"]["sampled"][t] >= TARGET_SAMPLED and r["after"]["greedy"][t] >= TARGET_GREEDY for r in results["seeds"].values() for t in ("bridge", "comparison")
    )
    results["target_met"] = met
    walls["total_s"] = time.time() - t0
    results["wall"] = walls
    print(f"gain: {statistics.mean(gains):+.1f} points (sampled held-out EM, mean over {len(gains)} seeds; per seed {', '.join(f'{g:+.1f}' for g in gains)}; +/- {spread:.1f} half-range, stdev {sd:.1f})")
    print(f"target (sampled >= {100 * TARGET_SAMPLED:.0f}%, greedy >= {100 * TARGET_GREEDY:.0f}% on both types, every seed): {'MET' if met else 'NOT MET'}")
    print("wall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in walls.items()))
    (out / "learning_check.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(curves, out / "reward_curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
