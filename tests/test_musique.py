"""MuSiQue records: paragraphs identified by (title, idx), aliases as answers, unanswerable records counted."""

import json
from pathlib import Path

import datasets
import pytest

from coordrl.cli import main
from coordrl.data import BuildConfig, SweepConfig, build_dataset, build_sweep
from coordrl.data.errors import BadRecordError, DataError
from coordrl.data.layout import Paragraph
from coordrl.data.pool import ParagraphPool, load_pool
from coordrl.data.records import load_records


def _para(idx, title, text, gold=False):
    return {"idx": idx, "title": title, "paragraph_text": text, "is_supporting": gold}


def _records() -> list[dict]:
    """Three answerable questions and one unanswerable one, in the official MuSiQue layout."""
    first = {
        "id": "2hop__100_200",
        "question": "Who founded the company that makes the Zorblat?",
        "answer": "Ada Quell",
        "answer_aliases": ["A. Quell", "Ada M. Quell"],
        "answerable": True,
        "paragraphs": [
            # Two different paragraphs titled "Zorblat": only the second one supports the answer.
            _para(0, "Zorblat", "Zorblat is a river in the north of Vandria."),
            _para(1, "Mirrow Works", "Mirrow Works was founded by Ada Quell in 1921.", gold=True),
            _para(2, "Zorblat", "The Zorblat is a bicycle made by Mirrow Works.", gold=True),
            _para(3, "Tessel", "Tessel is a village with a mill."),
        ],
        # Hop order: the Zorblat paragraph (idx 2) first, then the company (idx 1).
        "question_decomposition": [
            {"id": 200, "question": "Zorblat >> manufacturer", "answer": "Mirrow Works", "paragraph_support_idx": 2},
            {"id": 100, "question": "#1 >> founded by", "answer": "Ada Quell", "paragraph_support_idx": 1},
        ],
    }
    second = {
        "id": "2hop__300_400",
        "question": "In which country is the river that flows past Orlen?",
        "answer": "Vandria",
        "answer_aliases": [],
        "answerable": True,
        "paragraphs": [
            _para(0, "Orlen", "Orlen lies on the river Kast.", gold=True),
            _para(1, "Kast", "The Kast is a river in Vandria.", gold=True),
            _para(2, "Orlen", "Orlen is also a brand of pencils."),
        ],
        "question_decomposition": [
            {"id": 300, "question": "Orlen >> river", "answer": "Kast", "paragraph_support_idx": 0},
            {"id": 400, "question": "#1 >> country", "answer": "Vandria", "paragraph_support_idx": 1},
        ],
    }
    third = {  # MuSiQue-Ans layout: no answerable flag
        "id": "3hop1__1_2_3",
        "question": "What is the mill in Tessel made of?",
        "answer": "stone",
        "answer_aliases": ["rock"],
        "paragraphs": [_para(0, "Tessel", "The mill in Tessel is made of stone.", gold=True)],
        "question_decomposition": [{"id": 1, "question": "q", "answer": "stone", "paragraph_support_idx": 0}],
    }
    unanswerable = {**second, "id": "2hop__300_400_u", "answerable": False}
    unanswerable["paragraphs"] = [{**p, "is_supporting": False} for p in second["paragraphs"]]
    return [first, unanswerable, second, third]


def _write(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _doc_text(sample: dict, doc: int) -> str:
    offsets = sample["doc_offsets"]
    end = offsets[doc] - 2 if doc < len(offsets) else len(sample["context"])
    return sample["context"][offsets[doc - 1] : end]


def test_records_keep_same_titled_paragraphs_and_aliases(tmp_path):
    records, report = load_records(_write(tmp_path / "m.jsonl", _records()), "musique")
    assert [r.id for r in records] == ["2hop__100_200", "2hop__300_400", "3hop1__1_2_3"]
    assert report.read == 4 and report.kept == 3 and report.unanswerable == 1 and not report.skipped
    rec = records[0]
    assert [p.title for p in rec.paragraphs] == ["Zorblat", "Mirrow Works", "Zorblat", "Tessel"]
    assert rec.answers == ("Ada Quell", "A. Quell", "Ada M. Quell")
    assert rec.gold_paragraphs == (2, 1) and rec.gold_titles == ("Zorblat", "Mirrow Works")
    assert rec.supporting_facts == () and rec.type == "2hop" and not rec.keyed_by_title


def test_build_gold_documents_point_at_supporting_paragraphs(tmp_path):
    src = _write(tmp_path / "m.jsonl", _records())
    out = tmp_path / "train"
    build_dataset(BuildConfig(source=src, dataset="musique", pool="split", num_paragraphs=8, seed=1), out)
    ds = datasets.load_from_disk(str(out))
    assert ds["id"] == ["2hop__100_200", "2hop__300_400", "3hop1__1_2_3"]
    first = ds[0]
    assert first["dataset"] == "musique" and first["answers"] == ["Ada Quell", "A. Quell", "Ada M. Quell"]
    assert first["supporting_facts"] == []
    bodies = [_doc_text(first, d) for d in first["gold_documents"]]
    assert bodies[0].endswith("Zorblat\nThe Zorblat is a bicycle made by Mirrow Works.")
    assert bodies[1].endswith("Mirrow Works\nMirrow Works was founded by Ada Quell in 1921.")
    # Both Zorblat paragraphs are in the context: the same title did not make one a duplicate.
    assert first["context"].count("\nZorblat\n") == 2
    info = json.loads((out / "build.json").read_text())["source"]
    assert info["records unanswerable (skipped)"] == 1 and info["records skipped"] == 0
    assert "records unanswerable (skipped): `1`" in (out / "README.md").read_text()


def test_sweep_controls_place_gold_by_identity_not_title(tmp_path):
    src = _write(tmp_path / "m.jsonl", _records())
    manifest = build_sweep(
        SweepConfig(source=src, dataset="musique", pool="split", questions=2, lengths=[8], controls=["position"], control_length=8),
        tmp_path / "sweep",
    )  # fmt: skip
    assert manifest["source"]["records unanswerable (skipped)"] == 1
    start = datasets.load_from_disk(str(tmp_path / "sweep" / "position-start"))
    for s in start:
        assert s["gold_documents"] == list(range(1, len(s["gold_documents"]) + 1))
        if s["id"] == "2hop__300_400":
            assert _doc_text(s, 1).endswith("Orlen\nOrlen lies on the river Kast.")


def test_pool_excludes_copies_but_not_same_titled_paragraphs(tmp_path):
    records, _ = load_records(_write(tmp_path / "m.jsonl", _records()), "musique")
    rec = records[1]  # Orlen (gold), Kast (gold), Orlen (pencils)
    pool = ParagraphPool(
        [
            Paragraph("Orlen", "Orlen lies on the river Kast."),  # an exact copy of a gold paragraph
            Paragraph("Orlen", "Orlen is a small island."),  # another paragraph under the same title
            Paragraph("Kast", "Kast is a surname."),
            Paragraph("Quarry", "A quarry is a pit."),
        ],
        "test",
    )
    assert pool.excluded_for(rec) == {0}
    lines = [{"title": p.title, "text": p.body} for p in pool.paragraphs]
    pool_file = tmp_path / "pool.jsonl"
    pool_file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "pooled"
    # Three own paragraphs + all three usable pool paragraphs: every non-copy must be drawn.
    one = _write(tmp_path / "one.jsonl", [_records()[2]])
    build_dataset(BuildConfig(source=one, dataset="musique", pool=str(pool_file), num_paragraphs=6), out)
    s = datasets.load_from_disk(str(out))[0]
    assert "Orlen is a small island." in s["context"] and "Kast is a surname." in s["context"]
    assert s["context"].count("Orlen lies on the river Kast.") == 1
    # The split pool marks a record's gold paragraphs by identity: not the same-titled pencil brand.
    split = load_pool("split", records)
    assert sorted(split.paragraphs[i].body for i in split.gold_for[rec.id]) == [
        "Orlen lies on the river Kast.",
        "The Kast is a river in Vandria.",
    ]


@pytest.mark.parametrize(
    ("mutate", "problem", "field"),
    [
        (lambda r: r["paragraphs"][1].update(is_supporting="yes"), "bad_structure", "is_supporting"),
        (lambda r: r["paragraphs"][0].pop("paragraph_text"), "bad_structure", "paragraph_text"),
        (lambda r: r["paragraphs"][3].update(idx=1), "bad_structure", "idx"),
        (lambda r: r.update(answer_aliases="A. Quell"), "bad_answer", "answer_aliases"),
        (lambda r: r.update(answerable="yes"), "bad_structure", "answerable"),
        (lambda r: r.pop("paragraphs"), "missing_field", "paragraphs"),
        (lambda r: [p.update(is_supporting=False) for p in r["paragraphs"]], "no_supporting_facts", "is_supporting"),
    ],
)
def test_malformed_record_names_record_and_field_or_is_skipped(tmp_path, mutate, problem, field):
    raw = _records()
    mutate(raw[0])
    src = _write(tmp_path / "bad.jsonl", raw)
    with pytest.raises(BadRecordError) as err:
        load_records(src, "musique")
    assert err.value.problem == problem and "2hop__100_200" in str(err.value) and field in str(err.value)
    records, report = load_records(src, "musique", on_bad_record="skip")
    assert len(records) == 2 and report.skipped == {problem: 1} and report.unanswerable == 1


def test_cli_musique_flag_reports_unanswerable(tmp_path, capsys):
    src = _write(tmp_path / "m.jsonl", _records())
    code = main(
        ["data", "build", "--musique", src, "--pool", "split", "--num-paragraphs", "8", "--out", str(tmp_path / "o")]
    )
    assert code == 0
    assert "skipped 1 unanswerable record(s)" in capsys.readouterr().out
    with pytest.raises(DataError, match="ships no musique questions"):
        load_records("sample", "musique")
