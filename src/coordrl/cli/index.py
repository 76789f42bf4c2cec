"""`coordrl index`: build HMARS indexes (pages, memory cards, regional memories) for a dataset."""

from __future__ import annotations

import argparse

from coordrl.cli.args import add_break_lock_flag
from coordrl.envs.hmars_index import IndexSettings, build_indexes
from coordrl.rundir import RunLock

__all__ = ["add_index_parser"]


def _cmd_index(args: argparse.Namespace) -> int:
    settings = IndexSettings.of(args)  # the index flags are named after the settings' fields

    # One indexing run per cache folder: two would build the same keys and race on their files.
    with RunLock(args.cache, what="--cache", break_lock=args.break_lock):
        stats = build_indexes(args.data, args.cache, settings, args.concurrency, limit=args.limit)
    print(
        f"indexed {stats['total']} samples into {args.cache}: {stats['built']} built, {stats['cached']} cached, "
        f"{stats['failed']} failed; writer calls {stats['writer_calls']}, parse failures {stats['parse_failures']}, "
        f"backend errors {stats['backend_errors']} ({stats['seconds']:.1f} s)"
    )
    if stats["first_error"]:
        print(f"first error: {stats['first_error']}")
    return 1 if stats["failed"] else 0


def add_index_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``coordrl index`` (HMARS pages, cards and regional memories, cached and resumable)."""
    p = subparsers.add_parser(
        "index", help="build HMARS indexes (pages, memory cards, regional memories) for a dataset"
    )
    p.add_argument("--data", required=True, help="dataset folder written by `coordrl data build`")
    p.add_argument("--cache", required=True, help="index cache folder (JSON files; reruns skip what is there)")
    p.add_argument("--c-sub", type=int, default=16384, help="tokens per sub-agent region (default 16384)")
    p.add_argument("--page-tokens", type=int, default=1024, help="tokens per page (default 1024)")
    p.add_argument("--group-size", type=int, default=10, help="sub-agents per mid-agent (default 10)")
    p.add_argument("--writer", default="lexical", help="'lexical' or comma-separated OpenAI-compatible URLs")
    p.add_argument("--writer-model", default=None, help="model name served at the writer URLs")
    p.add_argument(
        "--writer-api-key-env", default="OPENAI_API_KEY", help="environment variable with the writer API key"
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer for pages (default: shipped coordrl tokenizer; use the policy's)"
    )
    p.add_argument("--concurrency", type=int, default=4, help="documents in flight (default 4)")
    p.add_argument("--limit", type=int, default=None, help="index only the first N samples")
    add_break_lock_flag(p, "--cache")
    p.set_defaults(func=_cmd_index)
    return p
