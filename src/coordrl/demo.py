"""The README's main job on embedded defaults: offline, CPU, minutes.

It builds a distractor-packed training set and a small evaluation sweep from the real HotpotQA
sample shipped with coordrl, shows one sample chunked the way readers see it, plays one PARSER
episode with the scripted baseline lead and lexical readers, runs a few GRPO steps of the tiny
offline policy through TRL (`configs/tiny_cpu.yaml`), then evaluates the checkpoint on the sweep,
exports it, and answers a question with the exported policy through the inference API.
"""

from __future__ import annotations

import time
from pathlib import Path

from coordrl.data.build import BuildConfig, SweepConfig, build_dataset, build_sweep
from coordrl.data.chunk import chunk_context
from coordrl.data.show import load_built, show_sample
from coordrl.data.tokens import cached_counter


def _rule(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def run_demo(out: Path, workers: int = 1) -> int:
    t0 = time.perf_counter()
    out = Path(out)
    _rule("1/7 training set: shipped HotpotQA dev sample, 200 paragraphs per question (PARSER recipe)")
    stats = build_dataset(BuildConfig(seed=0, workers=workers, jsonl=False, overwrite=True), out / "train")
    p, t = stats["paragraphs"], stats["tokens"]
    print(
        f"{stats['samples']} samples, {p['mean']:.0f} paragraphs each, tokens median {t['median']:,.0f} "
        f"(min {t['min']:,}, max {t['max']:,}); gold paragraphs per tenth of the document: {stats['gold_position_deciles']}"
    )

    _rule("2/7 evaluation sweep: the same 8 questions at 50..6400 paragraphs, plus robustness controls")
    manifest = build_sweep(
        SweepConfig(questions=8, controls=["position", "order", "distance"], control_length=200, workers=workers, overwrite=True),
        out / "sweep",
    )
    for sub in manifest["subsets"]:
        s = sub["stats"]
        print(f"  {sub['variant']:<18} {s['samples']} samples, median {s['tokens']['median']:>9,.0f} tokens -> {out / 'sweep' / sub['folder']}")

    _rule("3/7 one training sample, and how 512-token reader chunks cover it")
    print(show_sample(out / "train", 0, max_chars=700))
    sample = load_built(out / "train")[0]
    chunks = chunk_context(sample["context"], cached_counter(None).tokenizer, 512, sample["doc_offsets"])
    gold_chunks = [c.index for c in chunks if set(c.documents) & set(sample["gold_documents"])]
    print(f"\n{len(chunks)} reader chunks of <= 512 tokens; gold Documents {sample['gold_documents']} sit in chunks {gold_chunks}")

    _rule("4/7 one PARSER episode: scripted baseline lead, lexical readers over 512-token chunks")
    from coordrl.envs.chat import ChatCodec
    from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory
    from coordrl.envs.step import StepEnv
    from coordrl.rollout.episode import format_episode, run_episode
    from coordrl.rollout.policies import ScriptedLead

    tokenizer = cached_counter(None).tokenizer
    factory = ParserEnvFactory(ParserEnvConfig(max_turns=12), tokenizer=tokenizer)
    episode = run_episode(StepEnv(factory(), ChatCodec(tokenizer), max_turns=12), ScriptedLead(), sample)
    print(format_episode(episode, max_chars=400))

    _rule("5/7 GRPO on TRL: tiny offline policy, lexical readers (configs/tiny_cpu.yaml)")
    from coordrl.train.config import load_config
    from coordrl.train.run import latest_complete_checkpoint, train

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    if not config.exists():
        print(f"skipped: {config} not found (run the demo from a coordrl checkout)")
    else:
        run_dir = out / "grpo"
        cfg = load_config(config, {"output_dir": str(run_dir), "max_steps": 4, "save_steps": 2, "eval_steps": 2})
        train(cfg)
        rewards = [h["reward"] for h in _log_history(run_dir) if "reward" in h]
        print(f"GRPO steps: {len(rewards)}; mean reward per step {[round(r, 3) for r in rewards]} (a random-weight policy: expect 0)")
        print(f"latest complete checkpoint: {latest_complete_checkpoint(run_dir)}; final policy: {run_dir / 'final'}")
        print(f"wandb offline logs: {run_dir / 'wandb'}; rollout traces: {run_dir / 'traces'}")
        _evaluate_export_answer(out, run_dir / "final", sample)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s; everything under {out}")
    return 0


def _evaluate_export_answer(out: Path, checkpoint: Path, sample: dict) -> None:
    from coordrl.inference.coordinator import Coordinator
    from coordrl.inference.export import export_policy
    from coordrl.rollout.evaluate import EvalConfig, evaluate

    _rule("6/7 evaluate the checkpoint on the sweep (PARSER eval settings: 12 rounds, 4,096-token chunks)")
    eval_dir = out / "eval"
    evaluate(EvalConfig(policy=str(checkpoint), data=str(out / "sweep"), out=str(eval_dir), limit=2, overwrite=True))
    print((eval_dir / "results.md").read_text())
    print(f"plot: {eval_dir / 'accuracy_vs_length.png'}; traces: {eval_dir / 'traces'}")

    _rule("7/7 export the policy and answer a question with it (inference API)")
    exported = export_policy(checkpoint, out / "export", eval_dir=eval_dir, overwrite=True)
    print(f"exported to {exported}: {sorted(p.name for p in exported.iterdir())}")
    with Coordinator.from_pretrained(exported, readers="lexical") as coordinator:
        result = coordinator.answer(sample["context"], sample["question"])
    print(f"question: {sample['question']}\nanswer: {result.answer!r} (gold {sample['answers']}); "
          f"{len(result.evidence)} findings, {result.info.get('tool_rounds', 0)} tool rounds")


def _log_history(run_dir: Path) -> list[dict]:
    import json

    ckpt = max(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]), default=None)
    if ckpt is None or not (ckpt / "trainer_state.json").exists():
        return []
    return json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
