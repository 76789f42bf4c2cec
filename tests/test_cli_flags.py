"""Flags shared by subcommands are declared once: the same name means the same default, type and help."""

from __future__ import annotations

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


def test_rollout_offers_only_what_it_runs(capsys):
    # HMARS episodes run through `answer` and `eval`; rollout no longer offers a protocol it refuses.
    assert "--protocol" not in _actions("rollout")
    with pytest.raises(SystemExit) as e:
        main(["rollout", "--data", "x", "--protocol", "hmars"])
    assert e.value.code == 2 and "--protocol" in capsys.readouterr().err


def test_activation_is_offered_by_eval_and_answer(capsys):
    _same("--activation", ("eval", "answer"))
    for command in ("eval", "answer"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--activation {all,routed}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["answer", "--policy", "scripted", "--document", "-", "--question", "q", "--activation", "sometimes"])
    assert e.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err
