"""Held-out world reader prompts shared by the in-process and the vLLM-served reader tests."""

from __future__ import annotations

import json

from coordrl.data.world import make_world, world_splits
from coordrl.data.world_reader import META_NAME, built_docs_per_chunk, eval_examples, world_reader_dir


def kept_reader_heldout() -> list[dict]:
    """The held-out world rows of the kept world reader's recipe (chains it never saw in training), cut
    into the chunks it was built to read."""
    recipe = json.loads((world_reader_dir() / META_NAME).read_text())["recipe"]
    docs = built_docs_per_chunk(world_reader_dir())
    return world_splits(recipe["n_train"], recipe["n_heldout"], seed=0, docs_per_chunk=docs)["heldout"]


def probe_examples(heldout: list[dict]) -> list:
    """A few held-out prompts: one positive per relation, hard and absent negatives."""
    examples = eval_examples(heldout[:3], make_world(0))
    picked = [
        next(e for e in examples if e.kind == "positive" and relation in e.query)
        for relation in ("directed", "city", "decade")
    ]
    return picked + [e for e in examples if e.kind == "hard"][:2] + [e for e in examples if e.kind == "absent"][:1]
