"""`coordrl answer`: answer one question about one document with a policy."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from coordrl.cli.args import (
    add_episode_flags,
    add_parser_env_flags,
    add_policy_flags,
    parse_settings,
)
from coordrl.cli.args import positive_int as _positive
from coordrl.envs.protocols import get_protocol
from coordrl.inference.coordinator import DEFAULT_MAX_DOCUMENT_TOKENS, Coordinator, InputError

__all__ = ["add_answer_parser"]


def _cmd_answer(args: argparse.Namespace) -> int:
    if str(args.document) == "-":
        raw = sys.stdin.buffer.read()
    else:
        path = Path(args.document)
        if not path.is_file():
            raise InputError(f"--document {path}: no such file")
        raw = path.read_bytes()
    coord = Coordinator.from_pretrained(
        args.policy, readers=args.readers, reader_model=args.reader_model, policy_url=args.policy_url,
        device=args.device, max_turns=args.max_turns, chunk_tokens=args.chunk_tokens, served_model=args.served_model,
        max_new_tokens=args.max_new_tokens, max_document_tokens=args.max_document_tokens, hmars=parse_settings(args.hmars),
        reader_timeout_s=args.reader_timeout, reader_retries=args.reader_retries, chunk_overlap_tokens=args.chunk_overlap_tokens,
        activation=args.activation,
    )  # fmt: skip
    try:
        result = coord.answer(raw, args.question)
    finally:
        coord.close()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(result.answer if result.answer is not None else "(no answer)")
        figures = defaultdict(int, result.info, findings=len(result.evidence))  # a missing figure prints 0
        print(get_protocol(coord.protocol).answer_summary.format_map(figures), file=sys.stderr)
    return 0 if result.answer is not None else 1


def add_answer_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``coordrl answer``."""
    p = sub.add_parser(
        "answer",
        help="answer a question about a document with a trained coordinator",
        description=(
            "Answer QUESTION about the text in FILE with a policy (export, checkpoint, model folder or hub id) and "
            "its readers. Prints the answer (exit 0) or '(no answer)' (exit 1); --json prints answer, trace, evidence and info."
        ),
    )
    add_episode_flags(
        p,
        {"required": True, "help": "export or checkpoint folder, model folder, hub id, or 'scripted'"},
        max_turns_help="tool rounds (default 12)",
    )
    p.add_argument("--document", required=True, help="a UTF-8 text file ('-': standard input)")
    p.add_argument("--question", required=True)
    p.add_argument(
        "--max-document-tokens",
        type=_positive,
        default=DEFAULT_MAX_DOCUMENT_TOKENS,
        help="longest document accepted (default 1000000)",
    )
    p.add_argument("--json", action="store_true", help="print answer, trace, evidence and info as JSON")
    add_parser_env_flags(p)
    add_policy_flags(p)
    p.set_defaults(func=_cmd_answer)
    return p
