"""`coordrl export`: a training checkpoint as a standalone policy folder with its model card."""

from __future__ import annotations

import argparse
from pathlib import Path

from coordrl.inference.export import export_policy
from coordrl.inference.model_card import VLLM_TOOL_FLAGS

__all__ = ["add_export_parser"]


def _cmd_export(args: argparse.Namespace) -> int:
    out = export_policy(args.checkpoint, args.out, eval_dir=args.eval, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} -> {out}")
    print(f"serve it: vllm serve {out} {' '.join(VLLM_TOOL_FLAGS)}")
    return 0


def add_export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``coordrl export``."""
    p = sub.add_parser(
        "export",
        help="export a checkpoint as a servable Hugging Face folder (safetensors, chat template, coordrl_policy.json, model card)",
        description=(
            "Export a complete training checkpoint: safetensors weights (a LoRA adapter is merged with peft), the "
            "tokenizer with the chat template TRL trained with, coordrl_policy.json and a model card. "
            f"Serve the result with: vllm serve OUT {' '.join(VLLM_TOOL_FLAGS)}"
        ),
    )
    p.add_argument(
        "--checkpoint", type=Path, required=True, help="a checkpoint-<step> or final folder written by coordrl train"
    )
    p.add_argument("--out", type=Path, required=True, help="export folder (written atomically)")
    p.add_argument(
        "--eval",
        type=Path,
        default=None,
        metavar="DIR",
        help="a coordrl eval --out folder whose results.md goes into the model card",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_cmd_export)
    return p
