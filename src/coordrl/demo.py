"""The README's main job on embedded defaults: offline, CPU, about eight minutes.

Part 1, learning: start from the kept warm start (a tiny Qwen3 taught the tool protocol on
the synthetic multi-hop world, `coordrl.data.world`), evaluate it on held-out questions, train it
with GRPO through `coordrl train` (`configs/world_cpu.yaml` with training questions padded to mixed
lengths, `TRAIN_DOCS`, and the shared prompt pass; reward printed as it rises), evaluate again, measure accuracy against
document length (8 to 1,024 documents per question) for the trained policy, the warm start and the
one-round mapreduce baseline, export the policy and answer a held-out
question with it through the inference API.

Part 2, real data: build a distractor-packed training set and an evaluation sweep from the real
HotpotQA sample shipped with coordrl, show one sample chunked the way readers see it, play one
PARSER episode with the scripted baseline lead and lexical readers, run a few GRPO steps of the
tiny offline policy (`configs/tiny_cpu.yaml`; random weights, so its reward stays 0), evaluate the
checkpoint on the sweep, export it, and answer a question with the exported policy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from coordrl.data.build import BuildConfig, SweepConfig, build_dataset, build_sweep
from coordrl.data.chunk import chunk_context
from coordrl.data.show import load_built, show_sample
from coordrl.data.tokens import cached_counter

STEPS = 13
WORLD_LENGTHS = (8, 64, 256, 1024)  # documents per question in the length sweep
WORLD_LENGTH_QUESTIONS = 40  # held-out questions at each length
# Documents per GRPO training question (``world_train_docs``), one length drawn per question. Trained on
# the questions' own 7 documents alone, the policy fails on longer ones: it meets chunk numbers and
# reader counts it never saw (greedy 100 / 75 / 5 / 0% at 8 / 64 / 256 / 1,024 documents). Trained up to
# 256, 1,024 documents held on one CPU (92%) and not on another (62%): the longest length is trained too.
TRAIN_DOCS = (8, 64, 256, 1024)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _rule(step: int, title: str) -> None:
    head = f"{step}/{STEPS} {title}"
    print(f"\n=== {head} " + "=" * max(0, 70 - len(head)))


def run_demo(out: Path, workers: int = 1, world_steps: int = 120, world_eval: int = 60) -> int:
    """Run both parts; ``world_steps`` GRPO optimizer steps on the world (fixed work, so the result does not
    depend on the machine's speed; 4.7 minutes on 2 idle AVX2-only cores with the shared prompt pass), ``world_eval`` held-out
    questions evaluated."""
    t0 = time.perf_counter()
    out = Path(out)
    summary: dict[str, Any] = {}
    world_part(out / "world", summary, steps=world_steps, n_eval=world_eval)
    summary["world_s"] = time.perf_counter() - t0
    hotpot_part(out, summary, workers=workers)
    summary["total_s"] = time.perf_counter() - t0
    _print_summary(out, summary)
    return 0


# -- part 1: learning on the synthetic world --------------------------------------------------------


def world_part(out: Path, summary: dict[str, Any], *, steps: int, n_eval: int) -> None:
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coordrl.data.world import build_world_dataset
    from coordrl.rollout.models import WORLD_MODEL, resolve_model
    from coordrl.rollout.world import evaluate_world
    from coordrl.software import software
    from coordrl.train.config import load_config
    from coordrl.train.run import train

    _rule(1, "the synthetic multi-hop world: fresh chains per question, lexical readers (coordrl.data.world)")
    paths = build_world_dataset(out / "data", n_train=4000, n_heldout=200, seed=0)
    heldout = [dict(r) for r in load_built(paths["heldout"])]
    for row in (heldout[0], heldout[1]):
        print(
            f"[{row['type']}] {row['question']}  ->  {row['answers'][0]}   ({len(row['chunks'])} readers, gold Documents {row['gold_documents']})"
        )
    print("\n".join("  | " + line for line in heldout[0]["context"].splitlines()[:9]) + "\n  | ...")
    rows = heldout[:n_eval]

    def evaluate(path: str) -> dict[str, dict]:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32)
        return {
            "sampled": evaluate_world(model, tok, rows, sample=True, seed=0),
            "greedy": evaluate_world(model, tok, rows, sample=False, seed=0),
        }

    warm = resolve_model(WORLD_MODEL)
    _rule(2, f"the kept warm start (SFT on imperfect scripted demonstrations), {len(rows)} held-out questions")
    before = evaluate(warm)
    print(_em_table({"warm start": before}))

    train_docs = ", ".join(map(str, TRAIN_DOCS))
    _rule(
        3,
        f"GRPO through coordrl train, configs/world_cpu.yaml --world_train_docs [{train_docs}] --share_prompt_prefix true, {steps} steps",
    )
    run_dir = out / "grpo"
    overrides = {
        "output_dir": str(run_dir),
        "max_steps": str(steps),
        "world_train_docs": f"[{train_docs}]",
        # Each question's prompt forwarded once for its rollouts in the scoring pass: the same log-probs
        # within float rounding, a cheaper step (docs/training.md).
        "share_prompt_prefix": "true",
        "disable_tqdm": "true",
    }
    cfg = load_config(CONFIGS / "world_cpu.yaml", overrides)
    t = time.perf_counter()
    train(cfg, overwrite=True, trainer_cls=_reward_printing_trainer())  # a rerun replaces the demo's own earlier run
    summary["world_grpo_s"] = time.perf_counter() - t
    summary["world_steps"] = steps

    _rule(4, "the trained policy on the same held-out questions")
    after = evaluate(str(run_dir / "final"))
    print(_em_table({"warm start": before, "after GRPO": after}))
    summary["world"] = {"before": before, "after": after}

    _rule(
        5,
        f"accuracy against document length: the same {WORLD_LENGTH_QUESTIONS} held-out questions in {WORLD_LENGTHS[0]} to {WORLD_LENGTHS[-1]} documents",
    )
    summary["world"]["by_length"] = length_sweep(
        out, {"after GRPO": str(run_dir / "final"), "warm start": warm}, WORLD_LENGTH_QUESTIONS
    )
    # GRPO's sampled rollouts follow float sums that differ with the CPU's SIMD level, so the same command
    # gives other figures on another kind of host: the record says which one made it.
    summary["world"]["host"] = software()
    (out / "demo_world.json").write_text(json.dumps(summary["world"], indent=2) + "\n")

    _rule(6, "export the world policy and answer a held-out question through the inference API")
    from coordrl.inference.coordinator import Coordinator
    from coordrl.inference.export import export_policy

    exported = export_policy(run_dir / "final", out / "export", overwrite=True)
    print(f"exported to {exported}")
    row = next(r for r in heldout[n_eval:] if r["type"] == "bridge")
    with Coordinator.from_pretrained(
        exported, readers="lexical", max_turns=cfg.coord.max_turns, chunk_tokens=4096
    ) as coordinator:
        result = coordinator.answer(row["context"], row["question"])
    for f in result.evidence:
        print(f"  round {f['turn']}: asked {f['query']!r} -> {f['text']}")
    print(f"question: {row['question']}\nanswer: {result.answer!r} (gold {row['answers'][0]!r})")
    summary["world_answer"] = (row["question"], result.answer, row["answers"][0])


def length_sweep(out: Path, policies: dict[str, str], n: int) -> dict[str, dict[int, float]]:
    """Greedy held-out exact match of each policy, and of the one-round ``mapreduce`` baseline (the trained
    policy answering from one broadcast of the question), on the same ``n`` held-out questions padded with
    filler documents to each of `WORLD_LENGTHS`; prints a table and writes ``accuracy_vs_length.png``.

    The coordinator never reads the document, so what it sees does not grow with it: only the readers'
    work does (two documents per reader: 4 readers at 8 documents, 512 at 1,024)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coordrl.data.world import make_world, world_rows
    from coordrl.rollout.world import evaluate_world

    world = make_world(0)
    rows = {length: world_rows(n, 0, world, prefix="heldout", n_docs=length)[0] for length in WORLD_LENGTHS}
    runs = [(name, path, False) for name, path in policies.items()] + [
        ("mapreduce (one broadcast of the question)", next(iter(policies.values())), True)
    ]
    found: dict[str, dict[int, float]] = {}
    for name, path, mapreduce in runs:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32)
        found[name] = {
            length: evaluate_world(model, tok, r, sample=False, seed=0, mapreduce=mapreduce)["all"]
            for length, r in rows.items()
        }
    print("| policy (greedy) | " + " | ".join(f"{length} docs" for length in WORLD_LENGTHS) + " |")
    print("|---|" + "---:|" * len(WORLD_LENGTHS))
    for name, by_len in found.items():
        print(f"| {name} | " + " | ".join(f"{100 * by_len[length]:.0f}%" for length in WORLD_LENGTHS) + " |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plot skipped (the figures are in demo_world.json)")
        return found
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, by_len in found.items():
        ax.plot(WORLD_LENGTHS, [100 * by_len[length] for length in WORLD_LENGTHS], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(WORLD_LENGTHS, [str(length) for length in WORLD_LENGTHS])
    ax.set_xlabel("documents per question (2 per reader)")
    ax.set_ylabel("held-out exact match, greedy (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")  # the curves sit near 0% and 100%: keep the legend off them
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_length.png", dpi=120)
    plt.close(fig)
    print(f"plot: {out / 'accuracy_vs_length.png'}")
    return found


def _reward_printing_trainer():
    """CoordGRPOTrainer that prints one line per step (reward, tool calls) instead of TRL's log dicts."""
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    from coordrl.train.trainer import CoordGRPOTrainer

    class Line(TrainerCallback):
        def __init__(self) -> None:
            self.rewards: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                last = self.rewards[-10:]
                bar = "#" * round(20 * sum(last) / len(last))
                print(
                    f"  step {state.global_step:>3}  reward {logs['reward']:.2f}  (mean of last {len(last):>2}: {sum(last) / len(last):.2f} {bar:<20})"
                    f"  tool calls {float(logs.get('tools/call_frequency', 0)):.2f}  {float(logs.get('step_time', 0)):.1f}s",
                    flush=True,
                )

    class DemoTrainer(CoordGRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.remove_callback(PrinterCallback)
            self.remove_callback(ProgressCallback)
            self.add_callback(Line())

    return DemoTrainer


def _em_table(results: dict[str, dict]) -> str:
    lines = [
        "| policy | sampled bridge | sampled comparison | greedy bridge | greedy comparison |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        s, g = r["sampled"], r["greedy"]
        lines.append(
            f"| {name} | {100 * s['bridge']:.0f}% | {100 * s['comparison']:.0f}% | {100 * g['bridge']:.0f}% | {100 * g['comparison']:.0f}% |"
        )
    return "\n".join(lines)


# -- part 2: the same pipeline on real HotpotQA -----------------------------------------------------


def hotpot_part(out: Path, summary: dict[str, Any], workers: int) -> None:
    _rule(7, "training set: shipped HotpotQA dev sample, 200 paragraphs per question (PARSER recipe)")
    stats = build_dataset(BuildConfig(seed=0, workers=workers, jsonl=False, overwrite=True), out / "train")
    p, t = stats["paragraphs"], stats["tokens"]
    print(
        f"{stats['samples']} samples, {p['mean']:.0f} paragraphs each, tokens median {t['median']:,.0f} "
        f"(min {t['min']:,}, max {t['max']:,}); gold paragraphs per tenth of the document: {stats['gold_position_deciles']}"
    )

    _rule(8, "evaluation sweep: the same 8 questions at 50..6400 paragraphs, plus robustness controls")
    manifest = build_sweep(
        SweepConfig(
            questions=8, controls=["position", "order", "distance"], control_length=200, workers=workers, overwrite=True
        ),
        out / "sweep",
    )
    for sub in manifest["subsets"]:
        s = sub["stats"]
        print(
            f"  {sub['variant']:<18} {s['samples']} samples, median {s['tokens']['median']:>9,.0f} tokens -> {out / 'sweep' / sub['folder']}"
        )

    _rule(9, "one training sample, and how 512-token reader chunks cover it")
    print(show_sample(out / "train", 0, max_chars=700))
    sample = load_built(out / "train")[0]
    chunks = chunk_context(sample["context"], cached_counter(None).tokenizer, 512, sample["doc_offsets"])
    gold_chunks = [c.index for c in chunks if set(c.documents) & set(sample["gold_documents"])]
    print(
        f"\n{len(chunks)} reader chunks of <= 512 tokens; gold Documents {sample['gold_documents']} sit in chunks {gold_chunks}"
    )

    _rule(10, "one PARSER episode: scripted baseline lead, lexical readers over 512-token chunks")
    from coordrl.envs.chat import ChatCodec
    from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory
    from coordrl.envs.step import StepEnv
    from coordrl.rollout.episode import format_episode, run_episode
    from coordrl.rollout.policies import ScriptedLead

    tokenizer = cached_counter(None).tokenizer
    factory = ParserEnvFactory(ParserEnvConfig(max_turns=12), tokenizer=tokenizer)
    episode = run_episode(StepEnv(factory(), ChatCodec(tokenizer), max_turns=12), ScriptedLead(), sample)
    print(format_episode(episode, max_chars=400))

    _rule(11, "GRPO on TRL: tiny random-weight policy, lexical readers (configs/tiny_cpu.yaml)")
    from coordrl.rollout.models import latest_complete_checkpoint
    from coordrl.train.config import load_config
    from coordrl.train.run import train

    run_dir = out / "grpo"
    cfg = load_config(
        CONFIGS / "tiny_cpu.yaml", {"output_dir": str(run_dir), "max_steps": 4, "save_steps": 2, "eval_steps": 2}
    )
    train(cfg, overwrite=True)  # a rerun replaces the demo's own earlier run
    rewards = [h["reward"] for h in _log_history(run_dir) if "reward" in h]
    print(
        f"GRPO steps: {len(rewards)}; mean reward per step {[round(r, 3) for r in rewards]} (a random-weight policy: expect 0)"
    )
    print(f"latest complete checkpoint: {latest_complete_checkpoint(run_dir)}; final policy: {run_dir / 'final'}")
    print(f"wandb offline logs: {run_dir / 'wandb'}; rollout traces: {run_dir / 'traces'}")
    _evaluate_export_answer(out, run_dir / "final", sample, summary)


def _evaluate_export_answer(out: Path, checkpoint: Path, sample: dict, summary: dict[str, Any]) -> None:
    from coordrl.eval.evaluate import EvalConfig, evaluate
    from coordrl.inference.coordinator import Coordinator
    from coordrl.inference.export import export_policy

    _rule(12, "evaluate the checkpoint on the sweep (PARSER eval settings: 12 rounds, 4,096-token chunks)")
    eval_dir = out / "eval"
    evaluate(EvalConfig(policy=str(checkpoint), data=str(out / "sweep"), out=str(eval_dir), limit=2, overwrite=True))
    print((eval_dir / "results.md").read_text())
    print(f"plot: {eval_dir / 'accuracy_vs_length.png'}; traces: {eval_dir / 'traces'}")

    _rule(13, "export the policy and answer a question with it (inference API)")
    exported = export_policy(checkpoint, out / "export", eval_dir=eval_dir, overwrite=True)
    print(f"exported to {exported}: {sorted(p.name for p in exported.iterdir())}")
    with Coordinator.from_pretrained(exported, readers="lexical") as coordinator:
        result = coordinator.answer(sample["context"], sample["question"])
    print(
        f"question: {sample['question']}\nanswer: {result.answer!r} (gold {sample['answers']}); "
        f"{len(result.evidence)} findings, {result.info.get('tool_rounds', 0)} tool rounds"
    )
    summary["hotpot_answer"] = (sample["question"], result.answer, sample["answers"][0])


def _print_summary(out: Path, summary: dict[str, Any]) -> None:
    print("\n=== summary " + "=" * 62)
    w = summary.get("world")
    if w:
        b, a = w["before"], w["after"]
        print(
            f"world: held-out exact match, sampled {100 * b['sampled']['all']:.0f}% -> {100 * a['sampled']['all']:.0f}%, "
            f"greedy {100 * b['greedy']['all']:.0f}% -> {100 * a['greedy']['all']:.0f}% after {summary.get('world_steps', 0)} GRPO steps ({summary.get('world_grpo_s', 0) / 60:.1f} min) "
            f"({out / 'world' / 'demo_world.json'})"
        )
    by_length = (w or {}).get("by_length")
    if by_length:
        for name, found in by_length.items():
            print(f"  {name}: greedy EM " + ", ".join(f"{100 * v:.0f}% at {n} docs" for n, v in found.items()))
        print(f"  plot: {out / 'world' / 'accuracy_vs_length.png'}")
    host = (w or {}).get("host")
    if host:
        print(
            f"  host: {host['cpu']}, torch CPU kernels at {host['torch_cpu_capability']} (figures differ by host kind)"
        )
    if "world_answer" in summary:
        q, ans, gold = summary["world_answer"]
        print(f"world policy, exported: {q!r} -> {ans!r} (gold {gold!r})")
    if "hotpot_answer" in summary:
        q, ans, gold = summary["hotpot_answer"]
        print(f"HotpotQA pipeline ran end to end (tiny random-weight policy): {q!r} -> {ans!r} (gold {gold!r})")
    print(
        f"done in {summary.get('total_s', 0) / 60:.1f} min (world part {summary.get('world_s', 0) / 60:.1f} min); everything under {out}"
    )


def _log_history(run_dir: Path) -> list[dict]:
    import json

    ckpt = max(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]), default=None)
    if ckpt is None or not (ckpt / "trainer_state.json").exists():
        return []
    return json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
