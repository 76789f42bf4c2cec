import json
from pathlib import Path

import pytest

from coordrl.cli import main
from coordrl.data.show import load_built


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "data" in out and "demo" in out


def test_data_build_show_and_errors(tmp_path, capsys):
    out = tmp_path / "ds"
    assert (
        main(["data", "build", "--out", str(out), "--num-paragraphs", "30", "--num-samples", "4", "--seed", "2"]) == 0
    )
    assert "4 samples" in capsys.readouterr().out
    assert main(["data", "show", str(out), "--index", "1", "--max-chars", "100"]) == 0
    shown = capsys.readouterr().out
    assert "question:" in shown and "30 paragraphs" in shown
    # Existing output, bad index, both length flags: one clear line, exit 2, no traceback.
    assert main(["data", "build", "--out", str(out), "--num-paragraphs", "30"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["data", "show", str(out), "--index", "99"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["data", "build", "--out", str(tmp_path / "x"), "--num-paragraphs", "30", "--max-tokens", "900"]) == 2
    assert "not both" in capsys.readouterr().err


def test_bad_record_error_names_record_and_skip_counts(tmp_path, capsys):
    raw = [
        {
            "_id": "q1",
            "question": "Who?",
            "answer": "A",
            "supporting_facts": [["T1", 0]],
            "context": [["T1", ["A is here."]], ["T2", ["B."]]],
        },
        {"_id": "q2", "question": "What?", "answer": "", "supporting_facts": [["T3", 0]], "context": [["T3", ["C."]]]},
    ]
    src = tmp_path / "mini.json"
    src.write_text(json.dumps(raw))
    args = ["data", "build", "--hotpotqa", str(src), "--num-paragraphs", "12", "--out", str(tmp_path / "o")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "'q2'" in err and "empty_answer" in err and "Traceback" not in err
    assert main(args + ["--on-bad-record", "skip"]) == 0
    info = json.loads((tmp_path / "o" / "build.json").read_text())
    assert info["source"]["records skipped"] == {"empty_answer": 1} and info["stats"]["samples"] == 1
    assert main(["data", "build", "--hotpotqa", str(tmp_path / "missing.json"), "--out", str(tmp_path / "p")]) == 2
    assert "not found" in capsys.readouterr().err


def test_sweep_cli(tmp_path, capsys):
    out = tmp_path / "sw"
    assert (
        main(
            [
                "data",
                "sweep",
                "--questions",
                "2",
                "--lengths",
                "20,40",
                "--controls",
                "position",
                "--control-length",
                "30",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    manifest = json.loads((out / "sweep.json").read_text())
    assert [s["folder"] for s in manifest["subsets"]] == [
        "length-00020",
        "length-00040",
        "position-start",
        "position-middle",
        "position-end",
    ]
    assert main(["data", "sweep", "--questions", "2", "--controls", "bogus", "--out", str(tmp_path / "z")]) == 2
    assert "bogus" in capsys.readouterr().err


def _checkpoint(tmp_path: Path, meta: dict) -> Path:
    """A complete training checkpoint by hand: the tiny random Qwen3 plus coordrl's markers."""
    import shutil

    from coordrl.rollout.models import CHECKPOINT_META, COMPLETE_MARKER, TINY_MODEL, resolve_model

    folder = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(resolve_model(TINY_MODEL), folder)
    (folder / CHECKPOINT_META).write_text(json.dumps(meta))
    (folder / COMPLETE_MARKER).write_text("")
    return folder


def test_rollout_plays_a_checkpoint_with_its_recorded_prompt(tmp_path, capsys):
    """`coordrl rollout` loads a policy as eval and answer do: a checkpoint plays with the system prompt
    it was trained with, not the default lead prompt."""
    data = tmp_path / "ds"
    assert main(["data", "build", "--out", str(data), "--num-paragraphs", "30", "--num-samples", "1"]) == 0
    prompt = "You lead readers. Recorded-prompt marker 7319."
    ckpt = _checkpoint(tmp_path, {"protocol": "parser", "system_prompt": prompt, "env": {}})
    capsys.readouterr()
    argv = ["rollout", "--data", str(data), "--policy", str(ckpt), "--max-turns", "1", "--max-new-tokens", "4"]
    assert main([*argv, "--json"]) == 0
    episode = json.loads(capsys.readouterr().out)
    assert episode["messages"][0] == {"role": "system", "content": prompt}
    question = load_built(data)[0]["question"]
    assert question in episode["messages"][1]["content"]


def test_rollout_refuses_an_hmars_policy_by_name(tmp_path, capsys):
    data = tmp_path / "ds"
    assert main(["data", "build", "--out", str(data), "--num-paragraphs", "30", "--num-samples", "1"]) == 0
    ckpt = _checkpoint(tmp_path, {"protocol": "hmars", "system_prompt": "mid-agent", "env": {}})
    capsys.readouterr()
    assert main(["rollout", "--data", str(data), "--policy", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "is an hmars policy" in err and "coordrl answer" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("readers", "message"), [("bogus", "--readers must be"), ("http://127.0.0.1:9", "--reader-model")]
)
def test_rollout_bad_readers_is_a_one_line_error(tmp_path, capsys, readers, message):
    data = tmp_path / "ds"
    assert main(["data", "build", "--out", str(data), "--num-paragraphs", "30", "--num-samples", "1"]) == 0
    capsys.readouterr()
    assert main(["rollout", "--data", str(data), "--readers", readers]) == 2
    err = capsys.readouterr().err
    assert err.startswith("coordrl: error: ") and message in err and "Traceback" not in err
