"""The training-set builder and the evaluation sweep on the shipped HotpotQA sample."""

import filecmp
import itertools
import json
import random
from pathlib import Path

import datasets
import pytest

from coordrl.data import BuildConfig, SweepConfig, build_dataset, build_sweep
from coordrl.data.errors import BadRecordError, DataError
from coordrl.data.pack import PackSpec, pack_sample
from coordrl.data.pool import load_pool
from coordrl.data.records import load_records
from coordrl.data.tokens import cached_counter

MEMAGENT_POSITIONS_N200 = {7, 10, 17, 81, 88, 96, 109, 154, 177, 191}


@pytest.fixture(scope="module")
def full_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "train"
    build_dataset(BuildConfig(seed=3, jsonl=True), out)
    return out


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_same_seed_identical_files_for_1_and_2_workers(tmp_path):
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        build_dataset(BuildConfig(seed=11, num_samples=150, num_paragraphs=60, jsonl=True, workers=workers), out)
        outs.append(out)
    assert _files(outs[0]) == _files(outs[1])
    assert "samples.jsonl" in _files(outs[0]) and "README.md" in _files(outs[0])
    for name in _files(outs[0]):
        assert filecmp.cmp(outs[0] / name, outs[1] / name, shallow=False), name
    other = tmp_path / "seed12"
    build_dataset(BuildConfig(seed=12, num_samples=150, num_paragraphs=60, jsonl=True), other)
    assert not filecmp.cmp(outs[0] / "samples.jsonl", other / "samples.jsonl", shallow=False)


def test_sample_fields_and_gold_documents_point_at_gold_paragraphs(full_build):
    ds = datasets.load_from_disk(str(full_build))
    assert len(ds) == 396
    for s in ds.select(range(50)):
        assert s["num_paragraphs"] == 200
        assert s["question"] not in s["context"]
        titles = [s["context"][o:].split("\n", 2)[1] for o in s["doc_offsets"]]
        assert len(titles) == 200 and len(set(titles)) == 200, "a title appears twice in one context"
        for title, doc in zip(s["gold_titles"], s["gold_documents"]):
            assert s["context"][s["doc_offsets"][doc - 1] :].startswith(f"Document {doc}:\n{title}\n")
        for fact in s["supporting_facts"]:
            assert fact["document"] == s["gold_documents"][s["gold_titles"].index(fact["title"])]
        assert s["seed"] == 3 and s["variant"] == ""


def test_gold_positions_spread_uniformly(full_build):
    ds = datasets.load_from_disk(str(full_build))
    docs = [d for row in ds["gold_documents"] for d in row]
    assert len(set(docs)) > 150, "gold paragraphs keep landing on the same Documents"
    deciles = [0] * 10
    for d in docs:
        deciles[(d - 1) * 10 // 200] += 1
    # Uniform: each tenth holds ~10% of ~800 gold paragraphs; a position prior would empty most tenths.
    assert min(deciles) > 0.06 * len(docs), deciles
    card = (full_build / "README.md").read_text()
    assert "gold" in card.lower() and "CC BY-SA" in card


def test_memagent_mode_reproduces_reference_fixed_positions(tmp_path):
    out = tmp_path / "memagent"
    build_dataset(BuildConfig(seed=5, num_samples=40, shuffle="memagent"), out)
    ds = datasets.load_from_disk(str(out))
    for row in ds["gold_documents"]:
        assert set(row) <= MEMAGENT_POSITIONS_N200


def test_num_tokens_is_exact(full_build):
    tok = cached_counter(None).tokenizer
    ds = datasets.load_from_disk(str(full_build))
    for s in ds.select(range(5)):
        assert s["num_tokens"] == len(tok(s["context"], add_special_tokens=False)["input_ids"])
    assert "verified exact" in (full_build / "README.md").read_text()


def test_token_budget_mode(tmp_path):
    out = tmp_path / "budget"
    build_dataset(BuildConfig(seed=1, num_samples=20, num_paragraphs=None, max_tokens=6000), out)
    ds = datasets.load_from_disk(str(out))
    tok = cached_counter(None).tokenizer
    for s in ds:
        exact = len(tok(s["context"], add_special_tokens=False)["input_ids"])
        assert exact == s["num_tokens"] <= 6000
        assert s["num_tokens"] > 6000 - 700  # filled up to about one paragraph short of the budget


def test_sweep_same_questions_every_length_and_6400_paragraphs(tmp_path):
    out = tmp_path / "sweep"
    manifest = build_sweep(
        SweepConfig(questions=2, lengths=[50, 6400], controls=["position", "order", "distance"], control_length=100),
        out,
    )
    folders = [s["folder"] for s in manifest["subsets"]]
    assert folders[:2] == ["length-00050", "length-06400"]
    by_folder = {f: datasets.load_from_disk(str(out / f)) for f in folders}
    ids = {f: ds["id"] for f, ds in by_folder.items()}
    assert all(v == ids["length-00050"] for v in ids.values())
    assert by_folder["length-06400"]["num_paragraphs"] == [6400, 6400]
    assert min(by_folder["length-06400"]["num_tokens"]) > 500_000
    for s in by_folder["position-start"]:
        assert sorted(s["gold_documents"]) == list(range(1, len(s["gold_documents"]) + 1))
    for s in by_folder["position-end"]:
        g = len(s["gold_documents"])
        assert sorted(s["gold_documents"]) == list(range(101 - g, 101))
    for fwd, rev in zip(by_folder["order-forward"], by_folder["order-reversed"]):
        assert sorted(fwd["gold_documents"]) == sorted(rev["gold_documents"])
        assert fwd["gold_documents"] == sorted(fwd["gold_documents"])  # supporting-fact order first
        assert rev["gold_documents"] == sorted(rev["gold_documents"], reverse=True)
    for s in by_folder["distance-25"]:
        d = sorted(s["gold_documents"])
        assert all(b - a == 26 for a, b in itertools.pairwise(d))
        assert s["variant"] == "distance=25"
    assert json.loads((out / "sweep.json").read_text())["recipe"]["questions"] == 2


def test_distractor_sampling_does_not_scan_the_pool():
    records, _ = load_records("sample", "hotpotqa")
    counter = cached_counter(None)
    pool = load_pool("sample")
    costs = counter.paragraph_costs(pool.paragraphs[:1]) * len(pool)  # costs only feed num_tokens here

    class NoScan(list):
        reads = 0

        def __iter__(self):
            raise AssertionError("the pool was scanned")

        def __getitem__(self, i):
            NoScan.reads += 1
            return list.__getitem__(self, i)

    pool.paragraphs = NoScan(pool.paragraphs)
    rec = records[0]
    rec_costs = counter.paragraph_costs(rec.paragraphs)
    sample = pack_sample(
        rec,
        rec_costs,
        pool,
        costs,
        counter,
        PackSpec(num_paragraphs=400),
        seed=0,
        stream="t",
        index=0,
        sample_id=rec.id,
    )
    assert sample["num_paragraphs"] == 400
    assert NoScan.reads == 400 - len(rec.paragraphs)


def test_pool_exclusions_gold_for_and_titles():
    records, _ = load_records("sample", "hotpotqa")
    pool = load_pool("sample")
    rec = next(r for r in records if pool.gold_for.get(r.id))
    excluded = pool.excluded_for(rec)
    assert set(pool.gold_for[rec.id]) <= excluded
    titles = {p.title for p in rec.paragraphs}
    assert {i for i, p in enumerate(pool.paragraphs) if p.title in titles} <= excluded
    drawn = pool.draw(5000, excluded, random.Random(0))
    assert len(set(drawn)) == 5000 and not set(drawn) & excluded
    with pytest.raises(DataError, match="distractors are needed"):
        pool.draw(len(pool), excluded, random.Random(0), rec.id)


def _write_records(path: Path, records: list) -> str:
    path.write_text(json.dumps(records))
    return str(path)


def _good_raw():
    import gzip

    from coordrl.data.resources import shipped_path

    with gzip.open(shipped_path("hotpotqa"), "rt") as fh:
        return json.load(fh)[:6]


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda r: r.pop("answer"), "missing_field"),
        (lambda r: r.update(answer="  "), "empty_answer"),
        (lambda r: r.update(supporting_facts=[["No Such Page", 0]]), "gold_missing"),
        (lambda r: r.update(question=""), "empty_question"),
        (lambda r: r.update(context="oops"), "bad_structure"),
    ],
)
def test_bad_record_is_named_or_skipped_and_counted(tmp_path, mutate, problem):
    raw = _good_raw()
    mutate(raw[2])
    src = _write_records(tmp_path / "bad.json", raw)
    with pytest.raises(BadRecordError) as err:
        build_dataset(BuildConfig(source=src, num_paragraphs=30), tmp_path / "out")
    assert err.value.problem == problem and raw[2]["_id"] in str(err.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    build_dataset(BuildConfig(source=src, num_paragraphs=30, on_bad_record="skip"), tmp_path / "out")
    info = json.loads((tmp_path / "out" / "build.json").read_text())
    assert info["source"]["records skipped"] == {problem: 1}
    assert info["stats"]["samples"] == 5
    assert problem in (tmp_path / "out" / "README.md").read_text()


def test_duplicate_id_and_existing_output(tmp_path):
    raw = _good_raw()
    raw[4]["_id"] = raw[1]["_id"]
    src = _write_records(tmp_path / "dup.json", raw)
    with pytest.raises(BadRecordError, match="duplicate_id"):
        load_records(src, "hotpotqa")
    out = tmp_path / "out"
    build_dataset(BuildConfig(source=src, num_paragraphs=20, on_bad_record="skip"), out)
    with pytest.raises(DataError, match="--overwrite"):
        build_dataset(BuildConfig(source=src, num_paragraphs=20, on_bad_record="skip"), out)


def test_hub_layout_records_parse():
    from coordrl.data.records import parse_record

    raw = _good_raw()[0]
    hub = {
        "id": raw["_id"],
        "question": raw["question"],
        "answer": raw["answer"],
        "type": raw["type"],
        "supporting_facts": {
            "title": [t for t, _ in raw["supporting_facts"]],
            "sent_id": [i for _, i in raw["supporting_facts"]],
        },
        "context": {"title": [t for t, _ in raw["context"]], "sentences": [s for _, s in raw["context"]]},
    }
    assert parse_record(hub, "hotpotqa", 0) == parse_record(raw, "hotpotqa", 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("context", "oops", "context must be a list or dict, got str"),
        ("context", [["T", ["s"], "extra"]], "each context entry must be [title, [sentences]]"),
        ("context", {"title": ["T"], "sentences": []}, "context dict needs equal-length 'title' and 'sentences'"),
        ("supporting_facts", 3, "supporting_facts must be a list or dict, got int"),
        ("supporting_facts", ["T"], "each supporting fact must be [title, sentence_index]"),
        ("supporting_facts", {"title": ["T"]}, "supporting_facts dict needs equal-length 'title' and 'sent_id'"),
    ],
)
def test_bad_context_and_supporting_facts_layouts_are_named(field, value, message):
    from coordrl.data.records import parse_record

    raw = _good_raw()[0] | {field: value}
    with pytest.raises(BadRecordError, match="bad_structure") as err:
        parse_record(raw, "hotpotqa", 0)
    assert message in str(err.value)


def test_hub_context_may_call_its_sentences_content():
    from coordrl.data.records import parse_record

    raw = _good_raw()[0]
    hub = raw | {"context": {"title": [t for t, _ in raw["context"]], "content": [s for _, s in raw["context"]]}}
    assert parse_record(hub, "hotpotqa", 0) == parse_record(raw, "hotpotqa", 0)


def test_2wikimultihopqa_sample_builds(tmp_path):
    out = tmp_path / "wiki"
    build_dataset(BuildConfig(source="sample", dataset="2wikimultihopqa", num_samples=10, num_paragraphs=50), out)
    ds = datasets.load_from_disk(str(out))
    assert set(ds["dataset"]) == {"2wikimultihopqa"} and len(ds) == 10
    s = ds[0]
    # 2Wiki sentences carry no leading spaces: paragraphs must not glue sentences together.
    body = s["context"][s["doc_offsets"][s["gold_documents"][0] - 1] :].split("\n\n")[0]
    assert ".He " not in body and ".The " not in body
