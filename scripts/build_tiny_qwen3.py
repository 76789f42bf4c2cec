#!/usr/bin/env python
"""Build the tiny random-init Qwen3 model folder used by coordrl's tests and demo, fully offline.

Examples::

    python scripts/build_tiny_qwen3.py --out /tmp/tiny-qwen3
    python scripts/build_tiny_qwen3.py --out /tmp/tiny-qwen3 --hidden-size 128 --layers 2 --seed 1
    python scripts/build_tiny_qwen3.py --out /tmp/tiny-qwen3 --retrain-tokenizer --vocab-size 4096
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The model and tokenizer are built locally; make sure nothing tries to reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory for the model folder")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights (default 0)")
    parser.add_argument("--hidden-size", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="number of decoder layers (default 4)")
    parser.add_argument(
        "--retrain-tokenizer",
        action="store_true",
        help="train a new tokenizer on the shipped data instead of using the shipped tokenizer",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=8192, help="vocabulary size when retraining the tokenizer (default 8192)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the model folder and print what was written."""
    args = parse_args(argv)

    from coordrl.data.tokenizer import (
        load_shipped_tokenizer,
        shipped_training_texts,
        train_tokenizer,
    )
    from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

    if args.retrain_tokenizer:
        tokenizer = train_tokenizer(shipped_training_texts(), vocab_size=args.vocab_size)
        source = f"retrained on the shipped data (vocab_size={args.vocab_size})"
    else:
        tokenizer = load_shipped_tokenizer()
        source = "shipped (coordrl/resources/tokenizer)"

    out = build_tiny_qwen3(
        args.out, tokenizer=tokenizer, hidden_size=args.hidden_size, num_layers=args.layers, seed=args.seed
    )

    print(f"tiny Qwen3 model written to {out.resolve()}")
    print(f"  tokenizer: {source}, {len(tokenizer)} tokens")
    print(f"  hidden_size={args.hidden_size} layers={args.layers} seed={args.seed}")
    for path in sorted(out.iterdir()):
        if path.is_file():
            print(f"  {path.name:28s} {path.stat().st_size:>12,d} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
