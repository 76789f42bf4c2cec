"""The distractor paragraph pool and O(N) distractor sampling.

A pool is built once per job: deduplicated paragraphs, an index from title to pool ids and from
question id to the pool ids that are gold for it. Sampling a sample's distractors then costs
O(N) expected draws (rejection sampling against a small excluded set), never a scan of the pool:
the reference recipe rebuilt its candidate list with an O(pool) pass per sample.
"""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coordrl.data.errors import DataError
from coordrl.data.layout import Paragraph, join_sentences
from coordrl.data.records import QARecord
from coordrl.data.resources import shipped_path


@dataclass
class ParagraphPool:
    """Deduplicated distractor paragraphs with the indexes sampling needs."""

    paragraphs: list[Paragraph]
    source: str
    gold_for: dict[str, list[int]] = field(default_factory=dict)  # question id -> pool ids gold for it
    duplicates_dropped: int = 0
    skipped: Counter = field(default_factory=Counter)
    _by_title: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _by_paragraph: dict[Paragraph, int] = field(default_factory=dict, repr=False)  # built on first use

    def __post_init__(self) -> None:
        if not self._by_title:
            for i, p in enumerate(self.paragraphs):
                self._by_title.setdefault(p.title, []).append(i)

    def __len__(self) -> int:
        return len(self.paragraphs)

    def excluded_for(self, record: QARecord) -> set[int]:
        """Pool ids a record must never draw: any paragraph gold for this question, and copies.

        Where a title names one paragraph (HotpotQA, 2WikiMultiHopQA), anything titled like a
        paragraph already in the context is a copy or a second version of it. In MuSiQue two
        different paragraphs share a title as a matter of course, so only an exact copy (same title
        and text) of one of the record's paragraphs is excluded.
        """
        excluded: set[int] = set(self.gold_for.get(record.id, ()))
        if record.keyed_by_title:
            for p in record.paragraphs:
                excluded.update(self._by_title.get(p.title, ()))
            return excluded
        if not self._by_paragraph:
            self._by_paragraph = {p: i for i, p in enumerate(self.paragraphs)}  # deduplicated: one id each
        excluded.update(self._by_paragraph[p] for p in record.paragraphs if p in self._by_paragraph)
        return excluded

    def iter_draws(self, excluded: set[int], rng: random.Random):
        """Distinct pool ids outside ``excluded``, uniformly at random, one at a time (rejection sampling)."""
        taken = set(excluded)
        n = len(self.paragraphs)
        remaining = n - len(taken)
        while remaining > 0:
            j = rng.randrange(n)
            if j not in taken:
                taken.add(j)
                remaining -= 1
                yield j

    def draw(self, k: int, excluded: set[int], rng: random.Random, record_id: str = "") -> list[int]:
        """``k`` distinct pool ids outside ``excluded``, uniformly at random, in draw order."""
        available = len(self.paragraphs) - len(excluded)
        if k > available:
            raise DataError(
                f"pool {self.source!r} has {len(self.paragraphs)} paragraphs, {available} usable for "
                f"{record_id or 'this record'}, but {k} distractors are needed; use a larger pool or fewer paragraphs"
            )
        if k * 2 > available:
            # Rejection sampling degrades as k approaches the pool size; only then pay for a scan.
            candidates = [i for i in range(len(self.paragraphs)) if i not in excluded]
            return rng.sample(candidates, k)
        draws = self.iter_draws(excluded, rng)
        return [next(draws) for _ in range(k)]


def _pool_entry(obj: object, where: str) -> tuple[Paragraph, list[str]]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object")
    title = obj.get("title")
    if not isinstance(title, str) or not title.strip():
        raise DataError(f"{where}: missing or empty 'title'")
    sentences = obj.get("sentences")
    if isinstance(sentences, list) and sentences and all(isinstance(s, str) for s in sentences):
        body = join_sentences(sentences)
    elif isinstance(obj.get("text"), str) and obj["text"].strip():
        body = obj["text"]
    else:
        raise DataError(f"{where}: needs 'sentences' (list of strings) or non-empty 'text'")
    gold_for = obj.get("gold_for") or []
    if not isinstance(gold_for, list):
        raise DataError(f"{where}: 'gold_for' must be a list of question ids")
    return Paragraph(title, body), [str(g) for g in gold_for]


def _build(
    entries: Iterable[tuple[Paragraph, list[str]]], source: str, skipped: Counter | None = None
) -> ParagraphPool:
    index: dict[Paragraph, int] = {}
    paragraphs: list[Paragraph] = []
    gold_for: dict[str, list[int]] = {}
    dropped = 0
    for para, golds in entries:
        pid = index.get(para)
        if pid is None:
            pid = index[para] = len(paragraphs)
            paragraphs.append(para)
        else:
            dropped += 1
        for qid in golds:
            gold_for.setdefault(qid, []).append(pid)
    return ParagraphPool(paragraphs, source, gold_for, dropped, skipped or Counter())


def load_pool(spec: str, records: Sequence[QARecord] = (), on_bad_record: str = "error") -> ParagraphPool:
    """Load a distractor pool.

    Args:
        spec: ``sample`` (shipped pool, 26,616 Wikipedia paragraphs), ``split`` (the deduplicated
            paragraphs of ``records`` themselves, as MemAgent does), or a JSONL path (optionally
            gzipped) with ``title`` and ``sentences`` or ``text``, and optional ``gold_for``.
        records: the questions being built; with ``split`` they are the pool, and each record's own
            paragraphs are marked gold-for it when they are among its gold paragraphs.
        on_bad_record: ``skip`` counts malformed pool lines instead of raising.
    """
    if spec == "split":

        def split_entries():
            for rec in records:
                golds = set(rec.gold_paragraphs)
                for n, p in enumerate(rec.paragraphs):
                    yield p, ([rec.id] if n in golds else [])

        return _build(split_entries(), "split")
    path = shipped_path("pool") if spec == "sample" else Path(spec)
    if not path.exists():
        raise DataError(f"pool file not found: {path}")
    skipped: Counter = Counter()

    def file_entries():
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}: line {lineno}: invalid JSON ({e.msg})") from None
                    yield _pool_entry(obj, f"{path}: line {lineno}")
                except DataError:
                    if on_bad_record == "error":
                        raise
                    skipped["bad_pool_line"] += 1

    pool = _build(file_entries(), "sample" if spec == "sample" else str(path), skipped)
    if not pool.paragraphs:
        raise DataError(f"pool {path} holds no usable paragraphs")
    return pool
