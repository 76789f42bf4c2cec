"""`coordrl data build` and `coordrl data sweep`: packed datasets written with `datasets`.

Memory stays flat however large the build: samples are produced in windows by a pool of forked
workers (each sample is a pure function of its inputs, seed and index, see `coordrl.data.pack`),
consumed in index order, and streamed to Arrow (and JSONL) on disk. Output appears atomically:
everything is written to ``<out>.partial`` and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from coordrl import __version__
from coordrl.data.arrow_out import DiskDatasetWriter
from coordrl.data.card import SubsetStats, render_card
from coordrl.data.errors import BadRecordError, DataError
from coordrl.data.pack import PackSpec, Placement, pack_sample, sample_rng
from coordrl.data.pool import ParagraphPool, load_pool
from coordrl.data.records import LoadReport, QARecord, load_records
from coordrl.data.schema import FEATURES
from coordrl.data.tokens import TokenCounter, cached_counter

DEFAULT_LENGTHS = (50, 100, 200, 400, 800, 1600, 3200, 6400)
DEFAULT_CONTROL_LENGTH = 800
_WINDOW_PER_WORKER = 32


@dataclass
class SourceConfig:
    """What `coordrl data build` and `coordrl data sweep` share: where questions and distractors come
    from, how records are read, and how the output is written (field names match the CLI flags)."""

    source: str = "sample"
    dataset: str = "hotpotqa"
    pool: str = "sample"
    tokenizer: str | None = None
    seed: int = 0
    on_bad_record: str = "error"
    jsonl: bool = False
    workers: int = 1
    overwrite: bool = False


@dataclass
class BuildConfig(SourceConfig):
    """Inputs of `coordrl data build`."""

    num_paragraphs: int | None = 200
    max_tokens: int | None = None
    num_samples: int | None = None  # default: one sample per question; more reuses questions
    shuffle: str = "uniform"


@dataclass
class SweepConfig(SourceConfig):
    """Inputs of `coordrl data sweep`."""

    questions: int = 128
    lengths: Sequence[int] = DEFAULT_LENGTHS
    controls: Sequence[str] = ()
    control_length: int = DEFAULT_CONTROL_LENGTH


@dataclass
class Inputs:
    """Everything a worker needs; inherited by forked workers, never pickled per task."""

    records: list[QARecord]
    record_costs: list[list[int]]
    pool: ParagraphPool
    pool_costs: list[int]
    counter: TokenCounter


@dataclass
class Subset:
    """One dataset to write: a spec and, per sample index, (record index, sample id)."""

    name: str
    folder: Path
    spec: PackSpec
    stream: str
    items: list[tuple[int, str]]
    stats: SubsetStats = field(default_factory=SubsetStats)


_INPUTS: Inputs | None = None
_SUBSET: Subset | None = None
_SEED = 0


def _pack_index(index: int) -> dict[str, Any]:
    assert _INPUTS is not None and _SUBSET is not None
    rec_idx, sample_id = _SUBSET.items[index]
    return pack_sample(
        _INPUTS.records[rec_idx],
        _INPUTS.record_costs[rec_idx],
        _INPUTS.pool,
        _INPUTS.pool_costs,
        _INPUTS.counter,
        _SUBSET.spec,
        seed=_SEED,
        stream=_SUBSET.stream,
        index=index,
        sample_id=sample_id,
        variant=_SUBSET.name if _SUBSET.stream != "build" else "",
    )


def _iter_samples(subset: Subset, workers: int, desc: str) -> Iterator[dict[str, Any]]:
    """Samples of a subset in index order, from ``workers`` forked processes."""
    n = len(subset.items)
    bar = tqdm(total=n, desc=desc, unit="sample", dynamic_ncols=True)
    try:
        if workers <= 1:
            for i in range(n):
                yield _pack_index(i)
                bar.update()
            return
        window = workers * _WINDOW_PER_WORKER
        with mp.get_context("fork").Pool(workers) as procs:
            for start in range(0, n, window):
                for sample in procs.map(_pack_index, range(start, min(n, start + window)), chunksize=4):
                    yield sample
                    bar.update()
    finally:
        bar.close()


def _fingerprint(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_subset(subset: Subset, workers: int, jsonl: bool, fingerprint: str) -> dict[str, Any]:
    global _SUBSET
    _SUBSET = subset
    writer = DiskDatasetWriter(subset.folder, FEATURES, fingerprint)
    with open(subset.folder / "samples.jsonl", "w", encoding="utf-8") if jsonl else nullcontext() as jsonl_fh:
        for sample in _iter_samples(subset, workers, subset.name):
            subset.stats.add(sample)
            writer.write(sample)
            if jsonl_fh is not None:
                jsonl_fh.write(json.dumps(sample, ensure_ascii=False) + "\n")
    writer.close()
    return subset.stats.summary()


def fresh_partial(out: Path, overwrite: bool) -> Path:
    """An empty ``<out>.partial`` folder to write into and rename to ``out`` when complete.

    Refuses a non-empty ``out`` unless ``overwrite``; a folder that cannot be created is one line
    naming it (read-only filesystem, no permission, a file in the way), never a traceback.
    """
    occupied = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if occupied and not overwrite:
        raise DataError(f"output folder {out} exists and is not empty; pass --overwrite to replace it")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise DataError(
            f"--out {out} cannot be written: {e.strerror} ({e.filename}); choose a writable folder"
        ) from None
    return partial


def _finish_out(partial: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


@contextmanager
def _publishing(partial: Path, out: Path, inputs: Inputs, seed: int) -> Iterator[None]:
    """Write into ``partial`` with the worker globals set; ``partial`` becomes ``out`` only when the body
    finishes, and is deleted when it does not (Ctrl-C included), so ``out`` is never half written."""
    global _INPUTS, _SEED
    _INPUTS, _SEED = inputs, seed
    try:
        yield
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        _INPUTS = None
    _finish_out(partial, out)


@lru_cache(maxsize=2)
def _file_pool(spec: str, tokenizer: str | None, on_bad: str) -> tuple[ParagraphPool, list[int]]:
    """A file pool and its paragraph token costs, computed once per process (the slowest setup step)."""
    pool = load_pool(spec, (), on_bad)
    return pool, cached_counter(tokenizer).paragraph_costs(pool.paragraphs)


def _load_inputs(
    source: str, dataset: str, pool_spec: str, tokenizer: str | None, on_bad: str
) -> tuple[Inputs, LoadReport]:
    records, report = load_records(source, dataset, on_bad)
    counter = cached_counter(tokenizer)
    if pool_spec == "split":
        pool = load_pool(pool_spec, records, on_bad)
        pool_costs = counter.paragraph_costs(pool.paragraphs)
    else:
        pool, pool_costs = _file_pool(pool_spec, tokenizer, on_bad)
    flat = [p for r in records for p in r.paragraphs]
    flat_costs = counter.paragraph_costs(flat)
    record_costs, k = [], 0
    for r in records:
        record_costs.append(flat_costs[k : k + len(r.paragraphs)])
        k += len(r.paragraphs)
    # Real contexts for the additivity check: a record with pool paragraphs, and pool paragraphs alone.
    probe = [list(records[0].paragraphs) + pool.paragraphs[:30], pool.paragraphs[30:90]]
    counter.verify([p for p in probe if p])
    return Inputs(records, record_costs, pool, pool_costs, counter), report


def _check_fit(inputs: Inputs, report: LoadReport, spec: PackSpec, on_bad: str, keep: Sequence[int]) -> list[int]:
    """Record indices (from ``keep``) that can be packed under ``spec``; the rest error or are counted."""
    ok = []
    for i in keep:
        rec = inputs.records[i]
        try:
            if spec.num_paragraphs is not None and len(rec.paragraphs) > spec.num_paragraphs:
                raise BadRecordError(
                    rec.id, "too_many_paragraphs", f"{len(rec.paragraphs)} paragraphs > N={spec.num_paragraphs}"
                )
            if spec.max_tokens is not None:
                own = inputs.counter.headers_total(len(rec.paragraphs)) + sum(inputs.record_costs[i])
                if own > spec.max_tokens:
                    raise BadRecordError(
                        rec.id, "over_budget", f"its own paragraphs take {own} tokens > {spec.max_tokens}"
                    )
        except BadRecordError as err:
            if on_bad == "error":
                raise
            report.skip(err)
            report.kept -= 1
            continue
        ok.append(i)
    if not ok:
        raise DataError("no record can be packed with these settings")
    return ok


def _load_summary(report: LoadReport, inputs: Inputs, dataset: str) -> dict[str, Any]:
    unanswerable = {"records unanswerable (skipped)": report.unanswerable} if dataset == "musique" else {}
    return {
        "dataset": dataset,
        "questions": report.source,
        "records read": report.read,
        "records kept": report.kept,
        "records skipped": dict(sorted(report.skipped.items())) or 0,
        **unanswerable,
        "pool": inputs.pool.source,
        "pool paragraphs": len(inputs.pool),
        "pool duplicates dropped": inputs.pool.duplicates_dropped,
        "pool lines skipped": dict(inputs.pool.skipped) or 0,
        "skip_examples": report.examples,
    }


def build_dataset(cfg: BuildConfig, out: str | Path) -> dict[str, Any]:
    """Build a training set (PARSER recipe) into ``out``. Returns the statistics written to the card."""
    out = Path(out)
    spec = PackSpec(
        num_paragraphs=None if cfg.max_tokens else cfg.num_paragraphs, max_tokens=cfg.max_tokens, shuffle=cfg.shuffle
    )
    inputs, report = _load_inputs(cfg.source, cfg.dataset, cfg.pool, cfg.tokenizer, cfg.on_bad_record)
    usable = _check_fit(inputs, report, spec, cfg.on_bad_record, range(len(inputs.records)))
    n = cfg.num_samples if cfg.num_samples is not None else len(usable)
    if n < 1:
        raise DataError(f"--num-samples must be positive, got {n}")
    items = []
    for i in range(n):
        rec_idx = usable[i % len(usable)]
        rep = i // len(usable)
        rid = inputs.records[rec_idx].id
        items.append((rec_idx, rid if rep == 0 else f"{rid}#{rep}"))
    partial = fresh_partial(out, cfg.overwrite)
    subset = Subset("train", partial, spec, "build", items)
    recipe = {
        "coordrl": __version__,
        "kind": "build",
        "num_paragraphs": spec.num_paragraphs,
        "max_tokens": spec.max_tokens,
        "shuffle": spec.shuffle,
        "seed": cfg.seed,
        "num_samples": n,
        "tokenizer": inputs.counter.name,
        "token_count_method": "per-paragraph sum (verified exact)" if inputs.counter.additive else "whole-context",
    }
    with _publishing(partial, out, inputs, cfg.seed):
        stats = _write_subset(
            subset, cfg.workers, cfg.jsonl, _fingerprint(recipe | {"source": cfg.source, "pool": cfg.pool})
        )
        load = _load_summary(report, inputs, cfg.dataset)
        (partial / "build.json").write_text(
            json.dumps({"recipe": recipe, "source": load, "stats": stats}, indent=2, default=str) + "\n"
        )
        (partial / "README.md").write_text(render_card("coordrl training set", recipe, load, [("train", stats)]))
    return stats


def parse_controls(controls: Sequence[str], length: int) -> list[Placement]:
    """Expand ``position,order,distance`` into their variants at ``length`` paragraphs.

    position: start, middle, end. order: forward, reversed. distance (other paragraphs between
    consecutive gold paragraphs): 0, length/8, length/4, length/2.
    """
    out: list[Placement] = []
    for kind in controls:
        if kind == "position":
            out += [Placement("position", v) for v in ("start", "middle", "end")]
        elif kind == "order":
            out += [Placement("order", v) for v in ("forward", "reversed")]
        elif kind == "distance":
            out += [Placement("distance", str(d)) for d in dict.fromkeys((0, length // 8, length // 4, length // 2))]
        else:
            raise DataError(f"unknown control {kind!r}; choose from position, order, distance")
    return out


def subset_folder_name(variant: str) -> str:
    """Folder of a sweep subset: ``length-00200``, ``position-start``, ``distance-100``."""
    kind, _, value = variant.partition("=")
    return f"length-{int(value):05d}" if kind == "length" else f"{kind}-{value}"


def build_sweep(cfg: SweepConfig, out: str | Path) -> dict[str, Any]:
    """Evaluation sweep: the same questions at every length, plus the robustness controls."""
    out = Path(out)
    lengths = sorted(set(int(x) for x in cfg.lengths))
    if not lengths or min(lengths) < 1:
        raise DataError(f"--lengths must be positive integers, got {list(cfg.lengths)}")
    placements = parse_controls(cfg.controls, cfg.control_length)
    inputs, report = _load_inputs(cfg.source, cfg.dataset, cfg.pool, cfg.tokenizer, cfg.on_bad_record)
    shortest = min(lengths + ([cfg.control_length] if placements else []))
    usable = _check_fit(
        inputs, report, PackSpec(num_paragraphs=shortest), cfg.on_bad_record, range(len(inputs.records))
    )
    if cfg.questions > len(usable):
        raise DataError(f"--questions {cfg.questions} but only {len(usable)} usable records in {cfg.source}")
    chosen = sorted(sample_rng(cfg.seed, "sweep-questions", 0).sample(usable, cfg.questions))
    items = [(i, inputs.records[i].id) for i in chosen]
    variants = [(f"length={n}", PackSpec(num_paragraphs=n)) for n in lengths]
    variants += [(p.name, PackSpec(num_paragraphs=cfg.control_length, placement=p)) for p in placements]
    partial = fresh_partial(out, cfg.overwrite)
    recipe = {
        "coordrl": __version__,
        "kind": "sweep",
        "questions": cfg.questions,
        "lengths": lengths,
        "controls": [p.name for p in placements],
        "control_length": cfg.control_length if placements else None,
        "seed": cfg.seed,
        "tokenizer": inputs.counter.name,
        "token_count_method": "per-paragraph sum (verified exact)" if inputs.counter.additive else "whole-context",
    }
    rows = []
    with _publishing(partial, out, inputs, cfg.seed):
        for name, spec in variants:
            folder = partial / subset_folder_name(name)
            folder.mkdir()
            subset = Subset(name, folder, spec, name, items)
            fp = _fingerprint(recipe | {"variant": name, "source": cfg.source, "pool": cfg.pool})
            rows.append((name, _write_subset(subset, cfg.workers, cfg.jsonl, fp)))
        load = _load_summary(report, inputs, cfg.dataset)
        manifest = {
            "recipe": recipe,
            "source": load,
            "subsets": [{"variant": n, "folder": subset_folder_name(n), "stats": s} for n, s in rows],
        }
        (partial / "sweep.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        (partial / "README.md").write_text(render_card("coordrl evaluation sweep", recipe, load, rows))
    return manifest


def config_dict(cfg: BuildConfig | SweepConfig) -> dict[str, Any]:
    return asdict(cfg)
