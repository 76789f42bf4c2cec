"""Loading and validating multi-hop QA records (HotpotQA, 2WikiMultiHopQA, MuSiQue).

Sources, as given to ``--hotpotqa`` / ``--2wikimultihopqa`` / ``--musique``:

- ``sample``: the real sample shipped with coordrl (offline; HotpotQA and 2WikiMultiHopQA only).
- a path to the official JSON (a list of records) or JSONL, optionally gzipped.
- ``hub`` or ``hub:<repo_id>[@<split>]``: the Hugging Face hub through ``datasets`` (needs network;
  MuSiQue has no default repo, so it takes ``hub:<repo_id>[@<split>]`` only).

HotpotQA and 2WikiMultiHopQA: both official layouts are accepted, list-style
``context = [[title, [sentences]], ...]`` with ``supporting_facts = [[title, sent_id], ...]``, and
the hub's dict-style columns. Their paragraphs are identified by title.

MuSiQue (the official JSONL): ``paragraphs = [{idx, title, paragraph_text, is_supporting}, ...]``.
Two different paragraphs often share a title there, so a paragraph is identified by
``(title, idx)``, gold paragraphs are those marked ``is_supporting``, and ``answer_aliases`` are
accepted answers beside ``answer``. Records marked ``answerable: false`` (MuSiQue-Full) have no
answer to score; they are skipped and counted in `LoadReport.unanswerable`, whatever
``on_bad_record`` says.

Every problem names the record; ``on_bad_record="skip"`` counts skips instead of raising.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordrl.data.errors import BadRecordError, DataError
from coordrl.data.layout import Paragraph, join_sentences
from coordrl.data.resources import shipped_path

DATASETS = ("hotpotqa", "2wikimultihopqa", "musique")
# Datasets whose paragraphs are identified by title alone (a title appears once per context).
TITLE_KEYED = frozenset({"hotpotqa", "2wikimultihopqa"})
HUB_DEFAULTS = {
    # repo id, config, split; MuSiQue has no default repo (hub:<repo_id>[@<split>] names one)
    "hotpotqa": ("hotpotqa/hotpot_qa", "distractor", "validation"),
    "2wikimultihopqa": ("xanhho/2WikiMultihopQA", None, "dev"),
    "musique": (None, None, "validation"),
}


@dataclass(frozen=True)
class QARecord:
    """One validated question with its own paragraphs (gold + the dataset's distractors)."""

    id: str
    question: str
    answers: tuple[str, ...]  # the answer first, then its aliases (MuSiQue); every one is accepted
    paragraphs: tuple[Paragraph, ...]
    gold_titles: tuple[str, ...]  # in order of first appearance in supporting_facts
    supporting_facts: tuple[tuple[str, int], ...]  # empty for MuSiQue, which marks paragraphs, not sentences
    type: str
    dataset: str
    # Indices into ``paragraphs`` of the gold paragraphs, aligned with ``gold_titles``: what
    # identifies a gold paragraph, since in MuSiQue a title can name two different paragraphs.
    gold_paragraphs: tuple[int, ...]

    @property
    def keyed_by_title(self) -> bool:
        """Whether a title identifies one paragraph of this record's dataset (not MuSiQue)."""
        return self.dataset in TITLE_KEYED


@dataclass
class LoadReport:
    """What loading saw: records read, kept, and skips counted by problem."""

    source: str
    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    unanswerable: int = 0  # MuSiQue-Full records marked answerable: false, always skipped
    examples: list[str] = field(default_factory=list)  # first few skip messages, for the card

    def skip(self, err: BadRecordError) -> None:
        self.skipped[err.problem] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{err.record_id}: {err.problem}: {err.detail}")


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _iter_file(path: Path) -> Iterator[Any]:
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    name = path.name.removesuffix(".gz")
    with _open_text(path) as fh:
        if name.endswith(".jsonl"):
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
        else:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON at line {e.lineno} ({e.msg})") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
            yield from data


def _iter_hub(dataset: str, spec: str) -> Iterator[Any]:
    repo, config, split = HUB_DEFAULTS[dataset]
    if spec.startswith("hub:"):
        rest = spec[4:]
        repo, _, maybe_split = rest.partition("@")
        split = maybe_split or split
        config = None if repo != HUB_DEFAULTS[dataset][0] else config
    if not repo:
        raise DataError(f"{dataset} has no default hub dataset; pass hub:<repo_id>[@<split>] or a path to the JSONL")
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a core dependency
        raise DataError("loading from the hub needs the `datasets` package") from e
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # network, offline mode, unknown repo: say what was asked and why it failed
        raise DataError(
            f"could not load {repo!r} (config {config!r}, split {split!r}) from the Hugging Face hub: {e}. "
            "Offline? Pass a local path to the official JSON instead, or `sample` for the shipped sample."
        ) from None
    yield from ds


def iter_raw_records(spec: str, dataset: str) -> Iterator[Any]:
    """Raw records from a source spec (see module docstring)."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}; choose from {DATASETS}")
    if spec == "sample":
        if dataset not in TITLE_KEYED:
            raise DataError(f"coordrl ships no {dataset} questions; pass a path to the official JSONL")
        yield from _iter_file(shipped_path(dataset))
    elif spec == "hub" or spec.startswith("hub:"):
        yield from _iter_hub(dataset, spec)
    else:
        yield from _iter_file(Path(spec))


def _title_pairs(value: Any, field: str, second: tuple[str, ...], entry: str) -> list[tuple[Any, Any]]:
    """``(title, second)`` pairs of a record's ``field`` in either layout: the official list of
    ``[title, second]`` entries, or the hub's dict of two equal-length lists (``title`` and the first
    of the ``second`` keys it holds). ValueError naming ``field`` (``entry``: a bad list entry)."""
    if isinstance(value, Mapping):
        titles = value.get("title")
        seconds = next((value[key] for key in second if key in value), None)
        if not isinstance(titles, list) or not isinstance(seconds, list) or len(titles) != len(seconds):
            raise ValueError(f"{field} dict needs equal-length 'title' and '{second[0]}' lists")
        return list(zip(titles, seconds, strict=True))
    if isinstance(value, list):
        if not all(isinstance(item, (list, tuple)) and len(item) == 2 for item in value):
            raise ValueError(entry)
        return [(item[0], item[1]) for item in value]
    raise ValueError(f"{field} must be a list or dict, got {type(value).__name__}")


def _context_pairs(ctx: Any) -> list[tuple[str, list[str]]]:
    # Hub layout: {"title": [...], "sentences": [[...], ...]} ("content" in some copies).
    pairs = _title_pairs(ctx, "context", ("sentences", "content"), "each context entry must be [title, [sentences]]")
    out = []
    for title, sents in pairs:
        if not isinstance(title, str) or not title.strip():
            raise ValueError("a context paragraph has an empty or non-string title")
        if not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
            raise ValueError(f"paragraph {title!r}: sentences must be a list of strings")
        out.append((title, list(sents)))
    return out


def _supporting_pairs(sf: Any) -> list[tuple[str, int]]:
    # Hub layout: {"title": [...], "sent_id": [...]}.
    pairs = _title_pairs(sf, "supporting_facts", ("sent_id",), "each supporting fact must be [title, sentence_index]")
    out = []
    for title, idx in pairs:
        if not isinstance(title, str) or isinstance(idx, bool) or not isinstance(idx, int):
            raise ValueError("a supporting fact is not [string title, integer sentence index]")
        out.append((title, idx))
    return out


def _musique_paragraphs(raw: Any) -> tuple[list[Paragraph], list[int], list[int]]:
    """MuSiQue ``paragraphs`` -> (paragraphs in the given order, their ``idx``, positions of the
    supporting ones). Raises ValueError naming the entry and field."""
    if not isinstance(raw, list):
        raise ValueError(f"field 'paragraphs' must be a list, got {type(raw).__name__}")
    paragraphs, idxs, supporting = [], [], []
    for n, item in enumerate(raw):
        where = f"paragraphs[{n}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where} must be an object")
        idx, title, text, gold = (item.get(k) for k in ("idx", "title", "paragraph_text", "is_supporting"))
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise ValueError(f"{where}: field 'idx' must be an integer")
        if not isinstance(title, str) or not title.strip():
            raise ValueError(f"{where}: field 'title' must be a non-empty string")
        if not isinstance(text, str):
            raise ValueError(f"{where}: field 'paragraph_text' must be a string")
        if not isinstance(gold, bool):
            raise ValueError(f"{where}: field 'is_supporting' must be true or false")
        if idx in idxs:
            raise ValueError(f"{where}: idx {idx} is used twice (a paragraph is identified by its title and idx)")
        if gold:
            supporting.append(n)
        paragraphs.append(Paragraph(title, text))
        idxs.append(idx)
    return paragraphs, idxs, supporting


def _hop_order(decomposition: Any, idxs: list[int], supporting: list[int]) -> list[int]:
    """Supporting paragraph positions in hop order (``question_decomposition``'s
    ``paragraph_support_idx``), then any other supporting paragraph in the given order."""
    if decomposition is None:
        return supporting
    if not isinstance(decomposition, list) or not all(isinstance(step, Mapping) for step in decomposition):
        raise ValueError("field 'question_decomposition' must be a list of objects")
    position = {idx: n for n, idx in enumerate(idxs)}
    ordered: list[int] = []
    for step in decomposition:
        n = position.get(step.get("paragraph_support_idx"))
        if n is not None and n in supporting and n not in ordered:
            ordered.append(n)
    return ordered + [n for n in supporting if n not in ordered]


def _parse_musique(raw: Mapping, rid: str, source: str) -> QARecord:
    for name in ("question", "answer", "paragraphs"):
        if name not in raw or raw[name] is None:
            raise BadRecordError(rid, "missing_field", f"field {name!r} is missing", source)
    question = raw["question"]
    if not isinstance(question, str) or not question.strip():
        raise BadRecordError(rid, "empty_question", "question is empty", source)
    answer, aliases = raw["answer"], raw.get("answer_aliases") or []
    if not isinstance(answer, str):
        raise BadRecordError(rid, "bad_answer", "field 'answer' must be a string", source)
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise BadRecordError(rid, "bad_answer", "field 'answer_aliases' must be a list of strings", source)
    if not answer.strip():
        raise BadRecordError(rid, "empty_answer", "answer is empty", source)
    answers = list(dict.fromkeys(a.strip() for a in [answer, *aliases] if a.strip()))
    try:
        paragraphs, idxs, supporting = _musique_paragraphs(raw["paragraphs"])
        gold = _hop_order(raw.get("question_decomposition"), idxs, supporting)
    except ValueError as e:
        raise BadRecordError(rid, "bad_structure", str(e), source) from None
    if not paragraphs:
        raise BadRecordError(rid, "empty_context", "field 'paragraphs' is empty", source)
    if not gold:
        raise BadRecordError(rid, "no_supporting_facts", "no paragraph has is_supporting true", source)
    return QARecord(
        id=rid,
        question=question.strip(),
        answers=tuple(answers),
        paragraphs=tuple(paragraphs),
        gold_titles=tuple(paragraphs[n].title for n in gold),
        supporting_facts=(),
        type=rid.partition("__")[0] if "__" in rid else "",  # MuSiQue ids start with the hop type: 2hop__...
        dataset="musique",
        gold_paragraphs=tuple(gold),
    )


def _unanswerable(raw: Any, dataset: str) -> bool:
    """A MuSiQue-Full record marked ``answerable: false`` (a malformed flag is left to the parser)."""
    return dataset == "musique" and isinstance(raw, Mapping) and raw.get("answerable") is False


def parse_record(raw: Any, dataset: str, position: int, source: str = "") -> QARecord:
    """Validate one raw record. Raises `BadRecordError` naming the record and the problem."""
    if not isinstance(raw, Mapping):
        raise BadRecordError(
            f"#{position}", "not_an_object", f"expected a JSON object, got {type(raw).__name__}", source
        )
    if dataset == "musique":
        rid = raw.get("id")
        if not isinstance(rid, str) or not rid:
            raise BadRecordError(f"#{position}", "missing_field", "no 'id' string", source)
        answerable = raw.get("answerable", True)  # MuSiQue-Ans records have no flag: all are answerable
        if not isinstance(answerable, bool):
            raise BadRecordError(rid, "bad_structure", "field 'answerable' must be true or false", source)
        if not answerable:  # `load_records` skips and counts these before parsing
            raise BadRecordError(rid, "unanswerable", "the record is marked answerable: false", source)
        return _parse_musique(raw, rid, source)
    rid = raw.get("_id", raw.get("id"))
    if not isinstance(rid, str) or not rid:
        raise BadRecordError(f"#{position}", "missing_field", "no '_id'/'id' string", source)
    for name in ("question", "answer", "context", "supporting_facts"):
        if name not in raw or raw[name] is None:
            raise BadRecordError(rid, "missing_field", f"field {name!r} is missing", source)
    question = raw["question"]
    if not isinstance(question, str) or not question.strip():
        raise BadRecordError(rid, "empty_question", "question is empty", source)
    answer = raw["answer"]
    answers = [answer] if isinstance(answer, str) else answer
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise BadRecordError(rid, "bad_answer", "answer must be a string or a list of strings", source)
    answers = [a.strip() for a in answers if a.strip()]
    if not answers:
        raise BadRecordError(rid, "empty_answer", "answer is empty", source)
    try:
        pairs = _context_pairs(raw["context"])
        facts = _supporting_pairs(raw["supporting_facts"])
    except ValueError as e:
        raise BadRecordError(rid, "bad_structure", str(e), source) from None
    if not pairs:
        raise BadRecordError(rid, "empty_context", "context has no paragraphs", source)
    # 2WikiMultiHopQA sometimes lists the same paragraph twice; an exact repeat carries no
    # information and is kept once. Two different paragraphs under one title are ambiguous evidence.
    first: dict[str, list[str]] = {}
    for t, sents in pairs:
        if t in first and first[t] != sents:
            raise BadRecordError(rid, "duplicate_title", f"context has two different paragraphs titled {t!r}", source)
        first.setdefault(t, sents)
    pairs = list(first.items())
    titles = list(first)
    if not facts:
        raise BadRecordError(rid, "no_supporting_facts", "supporting_facts is empty", source)
    gold_titles = list(dict.fromkeys(t for t, _ in facts))
    missing = [t for t in gold_titles if t not in set(titles)]
    if missing:
        raise BadRecordError(rid, "gold_missing", f"gold title(s) {missing} not in its context", source)
    paragraphs = tuple(Paragraph(t, join_sentences(s)) for t, s in pairs)
    return QARecord(
        id=rid,
        question=question.strip(),
        answers=tuple(answers),
        paragraphs=paragraphs,
        gold_titles=tuple(gold_titles),
        supporting_facts=tuple(facts),
        type=str(raw.get("type") or ""),
        dataset=dataset,
        gold_paragraphs=tuple(titles.index(t) for t in gold_titles),
    )


def load_records(
    spec: str, dataset: str, on_bad_record: str = "error", raw: Iterable[Any] | None = None
) -> tuple[list[QARecord], LoadReport]:
    """Load and validate all records of a source.

    Args:
        spec: ``sample``, a file path, or ``hub[:repo[@split]]``.
        dataset: ``hotpotqa``, ``2wikimultihopqa`` or ``musique``.
        on_bad_record: ``error`` raises on the first bad record; ``skip`` counts it in the report.
        raw: already-loaded raw records (tests, callers with their own loader); ``spec`` then only names them.
    """
    if on_bad_record not in ("error", "skip"):
        raise DataError(f"--on-bad-record must be 'error' or 'skip', got {on_bad_record!r}")
    report = LoadReport(source=spec)
    records: list[QARecord] = []
    seen: set[str] = set()
    for position, item in enumerate(raw if raw is not None else iter_raw_records(spec, dataset)):
        report.read += 1
        if _unanswerable(item, dataset):
            report.unanswerable += 1
            continue
        try:
            rec = parse_record(item, dataset, position, spec)
            if rec.id in seen:
                raise BadRecordError(
                    rec.id, "duplicate_id", f"id already used by an earlier record (#{position})", spec
                )
        except BadRecordError as err:
            if on_bad_record == "error":
                raise
            report.skip(err)
            continue
        seen.add(rec.id)
        records.append(rec)
    report.kept = len(records)
    if not records:
        raise DataError(
            f"{spec}: no usable records (read {report.read}, skipped {dict(report.skipped)}, "
            f"unanswerable {report.unanswerable})"
        )
    return records, report
