"""The `coordrl` command.

Subcommands defined here: ``demo`` (the README's main job), ``train``, ``rollout`` and ``data
build / sweep / show``; ``eval``, ``export``, ``answer``, ``index`` and ``serve-readers`` come from
their modules in this package.
Errors a user can fix (bad flags, bad records, missing files) print one line naming the problem and
exit with status 2; they never dump a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from coordrl import __version__
from coordrl.cli.args import (
    UsageError,
    add_break_lock_flag,
    add_episode_flags,
    add_parser_env_flags,
    add_sampling_flags,
    reader_limits,
)
from coordrl.cli.args import positive_int as _positive
from coordrl.data.errors import DataError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _add_source_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--hotpotqa",
        metavar="PATH|hub|sample",
        help="HotpotQA questions: official JSON path, 'hub', or 'sample' (shipped, default)",
    )
    src.add_argument(
        "--2wikimultihopqa",
        dest="wiki2",
        metavar="PATH|hub|sample",
        help="2WikiMultiHopQA questions instead of HotpotQA",
    )
    src.add_argument(
        "--musique",
        metavar="PATH|hub:REPO[@SPLIT]",
        help="MuSiQue questions (official JSONL) instead of HotpotQA; unanswerable records are skipped and counted",
    )
    p.add_argument(
        "--pool",
        default="sample",
        metavar="PATH|split|sample",
        help="distractor paragraphs: JSONL path, 'split' (the questions' own paragraphs) or 'sample' (shipped, 26,616 paragraphs; default)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH|HUB_ID",
        help="tokenizer for token counts (default: coordrl's shipped tokenizer, offline)",
    )
    p.add_argument("--seed", type=int, default=0, help="build seed (default 0)")
    p.add_argument(
        "--out", required=True, type=Path, help="output folder (a datasets dataset saved to disk, plus README.md)"
    )
    p.add_argument(
        "--workers", type=_positive, default=1, help="worker processes; output is identical for any count (default 1)"
    )
    p.add_argument(
        "--on-bad-record",
        choices=("error", "skip"),
        default="error",
        help="stop on a bad record (default) or skip and count it in the card",
    )
    p.add_argument("--jsonl", action="store_true", help="also write samples.jsonl")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def _source(args: argparse.Namespace) -> tuple[str, str]:
    if args.wiki2:
        return args.wiki2, "2wikimultihopqa"
    if args.musique:
        return args.musique, "musique"
    return args.hotpotqa or "sample", "hotpotqa"


def _print_unanswerable(manifest: Path) -> None:
    """MuSiQue: say how many records were skipped as unanswerable (also in the manifest and card)."""
    import json

    n = json.loads(manifest.read_text())["source"].get("records unanswerable (skipped)")
    if n is not None:
        print(f"skipped {n} unanswerable record(s) (answerable: false)")


def _source_fields(args: argparse.Namespace) -> dict:
    """`coordrl.data.build.SourceConfig`'s fields from the flags build and sweep share."""
    source, dataset = _source(args)
    return {
        "source": source, "dataset": dataset, "pool": args.pool, "tokenizer": args.tokenizer, "seed": args.seed,
        "on_bad_record": args.on_bad_record, "jsonl": args.jsonl, "workers": args.workers, "overwrite": args.overwrite,
    }  # fmt: skip


def _cmd_data_build(args: argparse.Namespace) -> int:
    from coordrl.data.build import BuildConfig, build_dataset

    if args.max_tokens is not None and args.num_paragraphs is not None:
        raise UsageError("give --num-paragraphs or --max-tokens, not both")
    cfg = BuildConfig(
        **_source_fields(args),
        num_paragraphs=None if args.max_tokens else (args.num_paragraphs or 200),
        max_tokens=args.max_tokens,
        num_samples=args.num_samples,
        shuffle=args.shuffle,
    )
    t0 = time.perf_counter()
    stats = build_dataset(cfg, args.out)
    _print_stats(args.out, "train", stats, time.perf_counter() - t0)
    _print_unanswerable(args.out / "build.json")
    return 0


def _cmd_data_sweep(args: argparse.Namespace) -> int:
    from coordrl.data.build import SweepConfig, build_sweep

    cfg = SweepConfig(
        **_source_fields(args),
        questions=args.questions,
        lengths=args.lengths,
        controls=args.controls,
        control_length=args.control_length,
    )
    t0 = time.perf_counter()
    manifest = build_sweep(cfg, args.out)
    for sub in manifest["subsets"]:
        _print_stats(args.out / sub["folder"], sub["variant"], sub["stats"], None)
    _print_unanswerable(args.out / "sweep.json")
    print(f"sweep written to {args.out} in {time.perf_counter() - t0:.1f} s (manifest: sweep.json, card: README.md)")
    return 0


def _print_stats(folder: Path, name: str, s: dict, seconds: float | None) -> None:
    p, t = s["paragraphs"], s["tokens"]
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    print(
        f"{name}: {s['samples']} samples ({s['unique_questions']} questions) -> {folder}{took}\n"
        f"  paragraphs min/mean/max {p['min']}/{p['mean']}/{p['max']}; "
        f"tokens min/median/mean/max {t['min']}/{t['median']}/{t['mean']}/{t['max']}; total {s['total_tokens']:,}\n"
        f"  gold paragraphs per tenth of the document: {s['gold_position_deciles']}"
    )


def _cmd_data_show(args: argparse.Namespace) -> int:
    from coordrl.data.show import show_sample

    print(show_sample(args.data, args.index, max_chars=args.max_chars))
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    import json

    # Libraries print chatter on import (transformers announces wandb offline mode on stdout);
    # keep stdout for the episode itself so `--json` output parses.
    with contextlib.redirect_stdout(sys.stderr):
        episode = _rollout_episode(args)
    text = json.dumps(episode.to_dict(), indent=2, ensure_ascii=False) if args.json else _format(episode)
    # A lone surrogate in a tool call's arguments cannot be printed as UTF-8: print its JSON escape.
    print(text.encode("utf-8", "backslashreplace").decode("utf-8"))
    return 0


def _format(episode):
    from coordrl.rollout.episode import format_episode

    return format_episode(episode)


def _rollout_episode(args: argparse.Namespace):
    """One PARSER episode of ``args.policy``, resolved and loaded as ``eval`` and ``answer`` load it:
    a checkpoint or export plays with the system prompt and environment settings it was trained with."""
    from dataclasses import replace

    from coordrl.data.show import load_built
    from coordrl.envs.chat import ChatCodec
    from coordrl.envs.protocols import get_protocol
    from coordrl.envs.step import StepEnv
    from coordrl.rollout.episode import run_episode
    from coordrl.rollout.policy_source import load_policy, resolve_policy

    ds = load_built(args.data)
    if not 0 <= args.sample < len(ds):
        raise UsageError(f"--sample {args.sample} out of range: {args.data} holds {len(ds)} samples")
    source = resolve_policy(args.policy)
    if not get_protocol(source.protocol).uses_readers:
        raise UsageError(
            f"--policy {args.policy} is an {source.protocol} policy; rollout plays PARSER episodes "
            "(run HMARS episodes with coordrl answer or coordrl eval)"
        )
    try:
        config = source.env_config(
            readers=args.readers, reader_model=args.reader_model, max_turns=args.max_turns,
            chunk_tokens=args.chunk_tokens, chunk_overlap_tokens=args.chunk_overlap_tokens, activation=args.activation,
        )  # fmt: skip
        config = replace(config, **reader_limits(args))
    except ValueError as e:
        raise UsageError(str(e)) from None
    policy, tokenizer = load_policy(
        source, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )
    factory = get_protocol(source.protocol).factory(config, tokenizer=tokenizer)
    try:
        try:  # the reader fleet is built here: a bad --readers is a one-line error, not a traceback
            env = StepEnv(
                factory(), ChatCodec(tokenizer), max_turns=config.max_turns,
                prompt_fn=lambda row: source.prompt(row["question"]),
            )  # fmt: skip
        except ValueError as e:
            raise UsageError(str(e)) from None
        return run_episode(env, policy, ds[args.sample])
    finally:
        factory.close()


def _cmd_train(args: argparse.Namespace) -> int:
    from coordrl.train.config import ConfigError, load_config, parse_overrides

    try:
        cfg = load_config(args.config, parse_overrides(args.overrides))
        if args.dry_run:
            from coordrl.train.plan import PlanError, format_plan, make_plan

            try:
                print(format_plan(make_plan(cfg)))
            except PlanError as e:
                print(f"coordrl: plan refused: {e}", file=sys.stderr)
                return 2
            return 0
        from coordrl.train.run import train

        out = train(cfg, resume=args.resume, overwrite=args.overwrite, break_lock=args.break_lock)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    print(f"training finished; checkpoints and logs in {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from coordrl.demo import run_demo

    return run_demo(args.out, workers=args.workers, world_steps=args.world_steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coordrl",
        description="Train, evaluate and export coordinator policies for multi-agent long-document readers.",
    )
    parser.add_argument("--version", action="version", version=f"coordrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="the main job on embedded defaults (offline, CPU, minutes)")
    demo.add_argument("--out", type=Path, default=Path("out/demo"), help="output folder (default out/demo)")
    demo.add_argument("--workers", type=_positive, default=min(2, os.cpu_count() or 1))
    demo.add_argument(
        "--world-steps",
        type=_positive,
        default=120,
        help="GRPO optimizer steps of the world part (default 120: 5.3 minutes on 2 AVX512-BF16 cores; CPUs without bf16 train in fp32, slower)",
    )
    demo.set_defaults(func=_cmd_demo)

    train = sub.add_parser(
        "train",
        help="GRPO training of the coordinator (TRL)",
        description="Train with TRL's GRPOTrainer. Overrides use the YAML field names: --max_steps 2 --output_dir out.",
    )
    train.add_argument("--config", type=Path, required=True, help="YAML config (coordrl and GRPOConfig fields)")
    train.add_argument(
        "--dry-run", action="store_true", help="print the resolved plan (layout, batch, budget, memory) and exit"
    )
    train.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint in output_dir"
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="delete another run's checkpoints, final model and traces in output_dir first",
    )
    add_break_lock_flag(train, "output_dir")
    train.set_defaults(func=_cmd_train)

    rollout = sub.add_parser(
        "rollout",
        help="run one episode and print the conversation, findings, reward and info",
        description="One PARSER lead-agent episode. HMARS episodes run through `coordrl answer` and `coordrl eval`.",
    )
    rollout.add_argument("--data", type=Path, required=True, help="a dataset folder (data build, or one sweep subset)")
    rollout.add_argument("--sample", type=int, default=0, help="sample index (default 0)")
    add_episode_flags(
        rollout,
        {"default": "scripted", "help": "'scripted' (model-free baseline), a checkpoint, an export or a model folder"},
        max_turns=12,
        chunk_tokens=512,
        max_turns_help="tool rounds allowed (default 12, the evaluation cap)",
        chunk_tokens_help="tokens per reader chunk (default 512)",
    )
    rollout.add_argument("--max-new-tokens", type=_positive, default=256, help="tokens per policy turn (default 256)")
    rollout.add_argument("--json", action="store_true", help="print the episode as JSON")
    add_parser_env_flags(rollout)
    add_sampling_flags(rollout)
    rollout.set_defaults(func=_cmd_rollout)

    from coordrl.cli.serve import add_serve_readers_parser

    add_serve_readers_parser(sub)
    from coordrl.cli.answer import add_answer_parser
    from coordrl.cli.eval import add_eval_parser
    from coordrl.cli.export import add_export_parser

    add_eval_parser(sub)
    add_export_parser(sub)
    add_answer_parser(sub)
    from coordrl.cli.index import add_index_parser

    add_index_parser(sub)

    data = sub.add_parser("data", help="build training sets and evaluation sweeps")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION")
    data.set_defaults(func=lambda a: (data.print_help(), 2)[1])

    build = data_sub.add_parser("build", help="training set: each question's paragraphs plus pool distractors")
    _add_source_flags(build)
    build.add_argument("--num-paragraphs", type=_positive, default=None, help="paragraphs per sample (default 200)")
    build.add_argument(
        "--max-tokens", type=_positive, default=None, help="fill to this many tokens instead (PARSER: about 28000)"
    )
    build.add_argument(
        "--num-samples",
        type=_positive,
        default=None,
        help="samples to build (default: one per question; more reuses questions with fresh distractors)",
    )
    build.add_argument(
        "--shuffle",
        choices=("uniform", "memagent"),
        default="uniform",
        help="uniform: every sample shuffled independently (default); memagent: the reference's fixed positions",
    )
    build.set_defaults(func=_cmd_data_build)

    sweep = data_sub.add_parser(
        "sweep", help="evaluation sweep: the same questions at every length, plus robustness controls"
    )
    _add_source_flags(sweep)
    sweep.add_argument(
        "--questions", type=_positive, default=128, help="questions, the same at every length (default 128)"
    )
    sweep.add_argument(
        "--lengths",
        type=_int_list,
        default=[50, 100, 200, 400, 800, 1600, 3200, 6400],
        help="paragraph counts (default 50,100,...,6400)",
    )
    sweep.add_argument("--controls", type=_str_list, default=[], help="any of position,order,distance")
    sweep.add_argument(
        "--control-length", type=_positive, default=800, help="paragraphs in the control subsets (default 800)"
    )
    sweep.set_defaults(func=_cmd_data_sweep)

    show = data_sub.add_parser("show", help="print one sample of a built dataset")
    show.add_argument("data", type=Path, help="a dataset folder written by build (or one sweep subset)")
    show.add_argument("--index", type=int, default=0)
    show.add_argument("--max-chars", type=int, default=1500, help="context characters to print (default 1500)")
    show.set_defaults(func=_cmd_data_show)
    return parser


_PATH_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR}


def main(argv: Sequence[str] | None = None) -> int:
    # Building the parser imports the subcommands' libraries, and transformers prints a notice on
    # stdout at import (wandb offline mode); stdout is kept for results (`--json`).
    with contextlib.redirect_stdout(sys.stderr):
        parser = build_parser()
    # `train` takes arbitrary --<field> VALUE overrides; every other command is parsed strictly.
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "train":
        args.overrides = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (DataError, UsageError) as e:
        print(f"coordrl: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # An output path that cannot be written, met past the commands' own checks: one line, not a traceback.
        if e.errno not in _PATH_ERRNOS or not e.filename:
            raise
        print(f"coordrl: error: {e.filename}: {e.strerror}; choose a writable path", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("coordrl: interrupted", file=sys.stderr)
        return 130
