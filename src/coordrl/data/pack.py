"""Packing one question into a long distractor context: a pure function of (inputs, seed, index).

Every sample draws its randomness from its own generator seeded by ``(seed, stream, index)``, so a
sample does not depend on which worker built it, in what order, or how many workers ran: builds are
byte-identical across runs and worker counts (the reference recipe shared one RNG across forked
workers). Shuffling is per sample, so gold paragraphs land uniformly over positions; the
``memagent`` mode reproduces the reference's fixed ``Random(4)`` permutation for comparison.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from coordrl.data.errors import BadRecordError, DataError
from coordrl.data.layout import Paragraph, render_context
from coordrl.data.pool import ParagraphPool
from coordrl.data.records import QARecord
from coordrl.data.tokens import TokenCounter

SHUFFLE_MODES = ("uniform", "memagent")
CONTROL_KINDS = ("position", "order", "distance")
MEMAGENT_SHUFFLE_SEED = 4  # the reference seeds a fresh Random(4) for every sample


@dataclass(frozen=True)
class Placement:
    """A robustness control: where the gold paragraphs go instead of a random shuffle.

    - ``position``: ``start`` | ``middle`` | ``end``; the gold paragraphs sit together there.
    - ``order``: ``forward`` | ``reversed``; gold paragraphs evenly spread, in supporting-fact order
      or reversed.
    - ``distance``: an integer, the number of other paragraphs between consecutive gold paragraphs
      (centred in the document; reduced when the document is too short, see `gold_positions`).
    """

    kind: str
    value: str

    @property
    def name(self) -> str:
        return f"{self.kind}={self.value}"


@dataclass(frozen=True)
class PackSpec:
    """How long a sample is and how its paragraphs are ordered.

    Exactly one of ``num_paragraphs`` (the count N, default recipe 200) and ``max_tokens`` (fill
    with distractors while the context stays within this many tokens) is set.
    """

    num_paragraphs: int | None = 200
    max_tokens: int | None = None
    shuffle: str = "uniform"
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if (self.num_paragraphs is None) == (self.max_tokens is None):
            raise DataError("give exactly one of --num-paragraphs and --max-tokens")
        if self.num_paragraphs is not None and self.num_paragraphs < 1:
            raise DataError(f"--num-paragraphs must be positive, got {self.num_paragraphs}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise DataError(f"--max-tokens must be positive, got {self.max_tokens}")
        if self.shuffle not in SHUFFLE_MODES:
            raise DataError(f"--shuffle must be one of {SHUFFLE_MODES}, got {self.shuffle!r}")
        if self.placement is not None and self.placement.kind not in CONTROL_KINDS:
            raise DataError(f"unknown control {self.placement.kind!r}; choose from {CONTROL_KINDS}")


def sample_rng(seed: int, stream: str, index: int) -> random.Random:
    """The generator of one sample. A hash, not ``seed + index``, so nearby seeds do not overlap."""
    digest = hashlib.sha256(f"coordrl/{seed}/{stream}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def gold_positions(n: int, g: int, placement: Placement) -> list[int]:
    """0-based positions for ``g`` gold paragraphs in a document of ``n`` paragraphs."""
    if g > n:
        raise DataError(f"{g} gold paragraphs do not fit in {n} paragraphs")
    kind, value = placement.kind, placement.value
    if kind == "position":
        start = {"start": 0, "middle": (n - g) // 2, "end": n - g}.get(value)
        if start is None:
            raise DataError(f"position control takes start|middle|end, got {value!r}")
        return list(range(start, start + g))
    if kind == "order":
        if value not in ("forward", "reversed"):
            raise DataError(f"order control takes forward|reversed, got {value!r}")
        spread = [round((i + 1) * n / (g + 1)) - 1 for i in range(g)]
        return spread if len(set(spread)) == g and min(spread) >= 0 else list(range(g))
    if kind == "distance":
        try:
            d = int(value)
        except ValueError:
            raise DataError(f"distance control takes an integer, got {value!r}") from None
        if g > 1:
            d = min(max(d, 0), (n - 1) // (g - 1) - 1)
        span = (g - 1) * (d + 1) + 1
        start = (n - span) // 2
        return [start + i * (d + 1) for i in range(g)]
    raise DataError(f"unknown control {kind!r}")


def _order(items: list[Any], gold: list[Any], others: list[Any], spec: PackSpec, rng: random.Random) -> list[Any]:
    if spec.placement is None:
        if spec.shuffle == "memagent":
            random.Random(MEMAGENT_SHUFFLE_SEED).shuffle(items)
        else:
            rng.shuffle(items)
        return items
    rng.shuffle(others)
    if spec.placement.kind == "order" and spec.placement.value == "reversed":
        gold = gold[::-1]
    slots = gold_positions(len(items), len(gold), spec.placement)
    out: list[Any] = [None] * len(items)
    for pos, item in zip(slots, gold, strict=True):
        out[pos] = item
    rest = iter(others)
    return [item if item is not None else next(rest) for item in out]


def pack_sample(
    record: QARecord,
    record_costs: list[int],
    pool: ParagraphPool,
    pool_costs: list[int],
    counter: TokenCounter,
    spec: PackSpec,
    *,
    seed: int,
    stream: str,
    index: int,
    sample_id: str,
    variant: str = "",
) -> dict[str, Any]:
    """Build one sample. Fields are documented in `coordrl.data.schema.SAMPLE_FIELDS`."""
    rng = sample_rng(seed, stream, index)
    excluded = pool.excluded_for(record)
    own = [(p, record_costs[i]) for i, p in enumerate(record.paragraphs)]
    pool_item = lambda j: (pool.paragraphs[j], pool_costs[j])  # noqa: E731

    if spec.num_paragraphs is not None:
        k = spec.num_paragraphs - len(own)
        if k < 0:
            raise BadRecordError(
                record.id, "too_many_paragraphs", f"has {len(own)} paragraphs, more than N={spec.num_paragraphs}"
            )
        distractors = [pool_item(j) for j in pool.draw(k, excluded, rng, record.id)]
    else:
        budget = spec.max_tokens
        used = counter.headers_total(len(own)) + sum(c for _, c in own)
        if used > budget:
            raise BadRecordError(record.id, "over_budget", f"its own paragraphs take {used} tokens > {budget}")
        distractors = []
        for j in pool.iter_draws(excluded, rng):
            cost = pool_costs[j] + counter.header(len(own) + len(distractors) + 1)
            if used + cost > budget:
                break
            used += cost
            distractors.append(pool_item(j))

    # Gold paragraphs are known by their position in the record, never by title: in MuSiQue a
    # title can name a gold paragraph and a different, non-gold one.
    gold_rank = {n: rank for rank, n in enumerate(record.gold_paragraphs)}
    gold = [own[n] for n in record.gold_paragraphs]
    others = [it for n, it in enumerate(own) if n not in gold_rank] + distractors
    ordered = _order(own + distractors, gold, others, spec, rng)

    paragraphs: list[Paragraph] = [it[0] for it in ordered]
    context, offsets = render_context(paragraphs)
    num_tokens = (
        counter.context_tokens(paragraphs, [it[1] for it in ordered]) if counter.additive else counter.count(context)
    )
    # Items are fresh tuples, so identity tells two equal paragraphs apart.
    document = {id(it): i for i, it in enumerate(ordered, start=1)}
    gold_documents = [document[id(it)] for it in gold]
    doc_of = dict(zip(record.gold_titles, gold_documents, strict=True))  # title-keyed datasets' supporting facts
    return {
        "id": sample_id,
        "source_id": record.id,
        "dataset": record.dataset,
        "type": record.type,
        "question": record.question,
        "answers": list(record.answers),
        "context": context,
        "doc_offsets": offsets,
        "gold_titles": list(record.gold_titles),
        "gold_documents": gold_documents,
        "supporting_facts": [{"title": t, "sent_id": s, "document": doc_of[t]} for t, s in record.supporting_facts],
        "num_paragraphs": len(paragraphs),
        "num_tokens": num_tokens,
        "seed": seed,
        "sample_index": index,
        "variant": variant,
    }
