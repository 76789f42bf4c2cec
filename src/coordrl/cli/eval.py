"""`coordrl eval`: evaluate a policy on built datasets, or compare evaluations."""

from __future__ import annotations

import argparse
from pathlib import Path

from coordrl.cli.args import (
    UsageError,
    add_break_lock_flag,
    add_episode_flags,
    add_parser_env_flags,
    add_policy_flags,
    add_sampling_flags,
    parse_settings,
)
from coordrl.cli.args import positive_int as _positive
from coordrl.eval.baselines import BASELINES
from coordrl.eval.evaluate import EvalConfig, evaluate
from coordrl.eval.report import compare_results

__all__ = ["add_eval_parser"]


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.compare:
        if args.out is None:
            raise UsageError("--compare needs --out DIR for the comparison table and plot")
        compare_results(args.compare, args.out)
        print(
            f"comparison of {len(args.compare)} evaluations written to {args.out} (comparison.md, comparison.json, accuracy_vs_length.png)"
        )
        return 0
    missing = [
        flag for flag, value in (("--policy", args.policy), ("--data", args.data), ("--out", args.out)) if value is None
    ]
    if missing:
        raise UsageError(f"coordrl eval needs {', '.join(missing)} (or --compare OUT_A OUT_B ... --out DIR)")
    cfg = EvalConfig(
        policy=args.policy, data=str(args.data), out=str(args.out), readers=args.readers, reader_model=args.reader_model,
        policy_url=args.policy_url, served_model=args.served_model, max_turns=args.max_turns, chunk_tokens=args.chunk_tokens,
        chunk_overlap_tokens=args.chunk_overlap_tokens, activation=args.activation,
        limit=args.limit, concurrency=args.concurrency, baseline=args.baseline, drop_failed=args.drop_failed, seed=args.seed,
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, max_completion_tokens=args.max_completion_tokens,
        context_window=args.context_window, device=args.device, label=args.label, overwrite=args.overwrite, progress=not args.no_progress,
        hmars=parse_settings(args.hmars), reader_timeout_s=args.reader_timeout, reader_retries=args.reader_retries,
        break_lock=args.break_lock,
    )  # fmt: skip
    results = evaluate(cfg)
    run = results["run"]
    overall = results.get("overall") or {}
    score = (
        f"sub_em {100 * overall['sub_em']:.1f}, EM {100 * overall['em']:.1f}"
        if overall.get("sub_em") is not None
        else "no length subsets"
    )
    print(
        f"{results['label']}: {score} over {overall.get('samples', 0)} samples; ran {run['episodes_run']}, "
        f"resumed {run['episodes_skipped']}, failed {run['episodes_failed']} -> {args.out}/results.md"
    )
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``coordrl eval``."""
    p = sub.add_parser(
        "eval",
        help="evaluate a policy (or a baseline) on a sweep: results.json, results.md, traces, accuracy plot",
        description=(
            "Evaluate a coordinator over an evaluation sweep (or one dataset folder) with the training environment. "
            "Reruns into the same --out resume by sample id. --compare OUT_A OUT_B ... --out DIR writes a side-by-side table and plot."
        ),
    )
    add_episode_flags(
        p,
        {"default": None, "help": "checkpoint, exported folder, model folder, hub id, or 'scripted'"},
        max_turns_help="tool rounds per episode (default 12, PARSER's evaluation cap; hmars: per region, default training's cap)",
    )
    p.add_argument(
        "--data", type=Path, default=None, help="a sweep folder (coordrl data sweep) or a single dataset folder"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (results.json, results.md, traces/, accuracy_vs_length.png)",
    )
    p.add_argument("--limit", type=_positive, default=None, help="first N samples of each subset (default all)")
    p.add_argument("--concurrency", type=_positive, default=4, help="episodes in flight (default 4)")
    p.add_argument(
        "--baseline",
        choices=BASELINES,
        default=None,
        help="prompted (base model, same prompt), mapreduce (one broadcast round) or fullcontext (whole document in the prompt)",
    )
    p.add_argument(
        "--drop-failed",
        action="store_true",
        help="reference habit: leave failed requests out of the denominator (default: they score 0)",
    )
    p.add_argument(
        "--max-completion-tokens",
        type=_positive,
        default=None,
        help="cap on all turns and tool results of an episode (default none)",
    )
    p.add_argument(
        "--context-window", type=_positive, default=None, help="fullcontext window in tokens (default: the model's)"
    )
    p.add_argument("--label", default=None, help="name of this run in tables and plots")
    p.add_argument("--overwrite", action="store_true", help="discard earlier results in --out instead of resuming")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--compare", nargs="+", default=None, metavar="OUT", help="compare earlier eval folders instead of running one"
    )
    add_break_lock_flag(p, "--out")
    add_sampling_flags(p)
    add_parser_env_flags(p)
    add_policy_flags(p)
    p.set_defaults(func=_cmd_eval)
    return p
