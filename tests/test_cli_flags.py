"""Flags shared by subcommands are declared once: the same name means the same default, type and help."""

from __future__ import annotations

import json

import pytest

from coordrl.cli import build_parser, main


def _actions(name: str) -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {opt: a for a in sub.choices[name]._actions for opt in a.option_strings}


def _same(flag: str, commands: tuple[str, ...]) -> None:
    seen = {(a.default, a.type, a.help, a.metavar) for a in (_actions(c)[flag] for c in commands)}
    assert len(seen) == 1, (flag, seen)


@pytest.mark.parametrize(
    "flag", ["--readers", "--reader-model", "--reader-timeout", "--reader-retries", "--chunk-overlap-tokens"]
)
def test_reader_flags_are_one_declaration(flag):
    _same(flag, ("rollout", "eval", "answer"))


@pytest.mark.parametrize("flag", ["--policy-url", "--served-model", "--device", "--max-new-tokens", "--hmars"])
def test_policy_flags_are_one_declaration(flag):
    _same(flag, ("eval", "answer"))


@pytest.mark.parametrize("flag", ["--temperature", "--seed"])
def test_sampling_flags_are_one_declaration(flag):
    _same(flag, ("rollout", "eval"))


def test_break_lock_names_the_folder_each_command_locks():
    helps = {c: _actions(c)["--break-lock"].help for c in ("eval", "train", "index")}
    assert helps == {
        "eval": "take over --out's lock left by a run on another host",
        "train": "take over output_dir's lock left by a run on another host",
        "index": "take over --cache's lock left by a run on another host",
    }


def test_rollout_offers_only_what_it_runs(capsys):
    # HMARS episodes run through `answer` and `eval`; rollout no longer offers a protocol it refuses.
    assert "--protocol" not in _actions("rollout")
    with pytest.raises(SystemExit) as e:
        main(["rollout", "--data", "x", "--protocol", "hmars"])
    assert e.value.code == 2 and "--protocol" in capsys.readouterr().err


def test_activation_is_offered_by_rollout_eval_and_answer(capsys):
    _same("--activation", ("rollout", "eval", "answer"))
    for command in ("rollout", "eval", "answer"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--activation {all,routed}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["answer", "--policy", "scripted", "--document", "-", "--question", "q", "--activation", "sometimes"])
    assert e.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err


@pytest.fixture
def hmars_export(tmp_path):
    """A folder `resolve_policy` reads as an exported hmars policy: its settings are refused before
    any weights load, so empty weight files do."""
    folder = tmp_path / "hmars-policy"
    folder.mkdir()
    (folder / "coordrl_policy.json").write_text(json.dumps({"protocol": "hmars", "env": {}}))
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--activation", "routed"), ("--chunk-overlap-tokens", "16"), ("--chunk-tokens", "512"), ("--reader-model", "m")],
)
def test_parser_reader_flags_are_refused_for_hmars_policies(hmars_export, tmp_path, capsys, flag, value):
    # eval used to drop --activation / --chunk-overlap-tokens / --chunk-tokens for an hmars policy and run without them.
    data = tmp_path / "ds"
    assert main(["data", "build", "--out", str(data), "--num-paragraphs", "12", "--num-samples", "1"]) == 0
    doc = tmp_path / "doc.txt"
    doc.write_text("Ann was born in Oslo.")
    commands = {
        "eval": ["eval", "--policy", str(hmars_export), "--data", str(data), "--out", str(tmp_path / "out")],
        "answer": ["answer", "--policy", str(hmars_export), "--document", str(doc), "--question", "Where?"],
    }
    for name, argv in commands.items():
        capsys.readouterr()
        assert main([*argv, flag, value]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("coordrl: error: ") and f"{flag} (" in err and "hmars policy does not use" in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before the run started


def test_rollout_activation_reaches_the_environment(tmp_path, capsys):
    data = tmp_path / "ds"
    assert main(["data", "build", "--out", str(data), "--num-paragraphs", "60", "--num-samples", "1"]) == 0
    infos = {}
    for activation in (None, "routed"):
        flags = ["--activation", activation] if activation else []
        capsys.readouterr()
        assert main(["rollout", "--data", str(data), "--chunk-tokens", "64", "--json", *flags]) == 0
        infos[activation] = json.loads(capsys.readouterr().out)["info"]
    chunks = infos[None]["chunks"]
    assert chunks > 16 and infos[None]["activated_chunks_per_query"] == chunks  # default: every chunk reader
    assert 0 < infos["routed"]["activated_chunks_per_query"] <= 16  # bm25 top-8 + summary top-8
