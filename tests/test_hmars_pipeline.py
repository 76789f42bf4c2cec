"""``protocol: hmars`` through coordrl eval / export / answer and `Coordinator`, end to end on CPU.

A tiny mid-agent policy is trained for one GRPO step with scripted generation (module fixture), then
evaluated on a tiny sweep, exported, and asked questions. The tiny model has random weights, so its
broadcasts are noise: the model-driven tests check plumbing, files and the HMARS evidence columns;
a scripted broadcast (parsed by TRL through the same `StepEnv`) checks K > 1 regions and evidence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from coordrl.cli import main
from coordrl.data.build import SweepConfig, build_sweep
from coordrl.data.show import load_built
from coordrl.inference.coordinator import Coordinator
from coordrl.rollout.models import CHECKPOINT_META, COMPLETE_MARKER
from coordrl.rollout.policy_source import POLICY_META, resolve_policy
from coordrl.testing import scripted_trainer_class
from coordrl.train.config import load_config
from coordrl.train.run import build_trainer
from coordrl.train.trainer import CoordGRPOTrainer

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
EVAL_FLAGS = ["--max-new-tokens", "16", "--limit", "1", "--no-progress"]
HMARS_COLUMNS = {"recall", "pages_selected", "answer_prompt_tokens", "model_calls", "regions", "evidence_tokens"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hmars-train") / "run"
    c = load_config(
        ROOT / "configs" / "hmars_tiny_cpu.yaml",
        {"output_dir": str(out), "max_steps": "1", "save_steps": "1", "sample_num_paragraphs": "30"},
    )
    call = {
        "name": "broadcast",
        "arguments": {"interpretation": "Find the nationality of both people.", "hints": {"s0": "nationality"}},
    }
    build_trainer(c, trainer_cls=scripted_trainer_class(CoordGRPOTrainer, rounds=1, call=call)).train()
    ckpt = out / "checkpoint-1"
    assert (ckpt / COMPLETE_MARKER).exists()
    return ckpt


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hmars-data") / "sweep"
    build_sweep(SweepConfig(questions=2, lengths=[20, 40]), out)
    return out


@pytest.fixture(scope="module")
def export_dir(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hmars-export") / "hmars-tiny"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def row(sweep) -> dict:
    return dict(load_built(sweep / "length-00040")[0])


class ScriptedBroadcast:
    """Text policy: one broadcast naming the question, with a hint for every sub-agent it is shown."""

    def act(self, env) -> str:
        memory = env.messages[1]["content"]
        subs = sorted(
            {
                w.strip(",.:;()[]")
                for w in memory.split()
                if w.strip(",.:;()[]")[:1] == "s" and w.strip(",.:;()[]")[1:].isdigit()
            }
        )
        question = memory.split("\n", 1)[0].removeprefix("Question: ")
        call = {"name": "broadcast", "arguments": {"interpretation": question, "hints": {s: question for s in subs}}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_eval_reports_hmars_evidence_metrics(checkpoint, sweep, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "--policy", str(checkpoint), "--data", str(sweep), "--out", str(out), *EVAL_FLAGS]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"] == "hmars" and results["env"]["c_sub"] == 2048 and results["settings"]["max_turns"] == 1
    for s in results["subsets"]:
        assert set(s["metrics"]) >= HMARS_COLUMNS and s["metrics"]["samples"] == 1 and s["metrics"]["failed"] == 0
        assert s["metrics"]["model_calls"] >= 1 and s["metrics"]["regions"] == 1  # answer model at least; one mid-agent
    assert set(results["overall"]) >= HMARS_COLUMNS and "reader_calls" in results["overall"]
    trace = json.loads((out / "traces" / "length-00020.jsonl").read_text().splitlines()[0])
    assert (
        trace["status"] == "ok"
        and trace["messages"][0]["role"] == "system"
        and trace["messages"][1]["content"].startswith("Question: ")
    )
    assert "Regional memory" in trace["messages"][1]["content"] or len(trace["messages"][1]["content"]) > 200
    assert {"regions", "evidence", "scores", "lead_prompt_tokens"} <= set(trace) and trace["info"]["answer_calls"] == 1
    md = (out / "results.md").read_text()
    assert "evidence recall" in md and "pages selected" in md and "answer prompt tokens" in md and "model calls" in md
    assert "queries/turn" not in md  # PARSER's reader columns stay PARSER's
    # Region settings from the checkpoint, overridable; the rerun with other settings is refused.
    assert (
        main(
            [
                "eval",
                "--policy",
                str(checkpoint),
                "--data",
                str(sweep),
                "--out",
                str(out),
                *EVAL_FLAGS,
                "--hmars",
                "c_sub=1024",
            ]
        )
        == 2
    )


def test_export_records_the_hmars_protocol(export_dir, checkpoint):
    meta = json.loads((export_dir / POLICY_META).read_text())
    assert meta["protocol"] == "hmars" and [t["function"]["name"] for t in meta["tools"]] == ["broadcast"]
    assert set(meta["tools"][0]["function"]["parameters"]["properties"]) == {"interpretation", "hints"}
    assert "broadcast" in meta["system_prompt"] and meta["env"]["c_sub"] == 2048 and meta["env"]["tokenizer"] is None
    assert meta["hmars"]["page_tokens"] == 512 and meta["turn_caps"]["train_max_turns"] == 1
    card = (export_dir / "README.md").read_text()
    assert "HMARS mid-agent" in card and "broadcast(interpretation" in card
    source = resolve_policy(export_dir)
    assert (
        source.kind == "export"
        and source.protocol == "hmars"
        and source.prompt("Q?")[0]["content"] == meta["system_prompt"]
    )
    assert json.loads((checkpoint / CHECKPOINT_META).read_text())["system_prompt"] == meta["system_prompt"]


def test_coordinator_runs_every_region_with_the_policy(export_dir, checkpoint, row):
    exported = Coordinator.from_pretrained(export_dir, hmars={"group_size": 2}, max_new_tokens=16)
    ckpt = Coordinator.from_pretrained(checkpoint, hmars={"group_size": 2}, max_new_tokens=16)
    try:
        a = exported.answer(row["context"], row["question"])
        b = ckpt.answer(row["context"], row["question"])
    finally:
        exported.close()
        ckpt.close()
    assert a.info["regions"] > 1 and len(a.trace) == a.info["regions"]
    assert all(t["messages"][0]["role"] == "system" and t["messages"][2]["role"] == "assistant" for t in a.trace)
    assert a.info["answer_calls"] == 1 and "em" not in a.info and a.info["document_tokens"] > 4000
    assert (
        a.trace == b.trace and a.answer == b.answer
    )  # greedy from the same ids: the export behaves like the checkpoint


def test_coordinator_merges_evidence_of_all_regions(export_dir, row):
    base = Coordinator.from_pretrained(export_dir, hmars={"group_size": 2}, max_new_tokens=16)
    base.close()
    coord = Coordinator(ScriptedBroadcast(), base.tokenizer, base.source, base.config, max_turns=1)
    try:
        result = coord.answer(row["context"], row["question"])
    finally:
        coord.close()
    k = result.info["regions"]
    assert k > 1 and [t["region"] for t in result.trace] == list(range(k)) and not any(t["error"] for t in result.trace)
    assert result.info["broadcasts"] == k and result.info["tool_errors"] == 0
    # TRL parsed each region's tool call; each region's sub-agents selected only their own pages.
    assert all(t["messages"][2]["tool_calls"][0]["function"]["name"] == "broadcast" for t in result.trace)
    pages = [e["page"] for e in result.evidence]
    assert pages == sorted(pages) and pages == sorted({p for t in result.trace for p in t["pages"]})
    assert pages and result.answer and all(e["page"] in result.trace[e["region"]]["pages"] for e in result.evidence)
    assert (
        result.info["selector_calls"] == result.info["subagents"] > result.info["participants"] / k
    )  # every region fanned out
    assert (
        result.info["pages_selected"] == len(pages) and result.info["model_calls"] == result.info["selector_calls"] + 1
    )


def test_region_prompts_are_the_training_prompts(export_dir, row):
    from coordrl.envs.chat import ChatCodec
    from coordrl.envs.hmars import HmarsEnvFactory
    from coordrl.envs.hmars_prompts import hmars_prompt
    from coordrl.envs.step import StepEnv

    source = resolve_policy(export_dir)
    cfg = source.env_config()
    f = HmarsEnvFactory(cfg)
    codec = ChatCodec(f.tokenizer)
    train = StepEnv(f(), codec, max_turns=1, prompt_fn=lambda r: hmars_prompt(r["question"]))
    region = StepEnv(
        f(region=0, answers=False),
        codec,
        max_turns=1,
        prompt_fn=lambda r: hmars_prompt(r["question"]),
    )
    train.reset(**row)
    region.reset(**row)
    assert region.prompt_ids == train.prompt_ids  # same tool schema, same memory: the tokens training saw


def test_memory_settings_are_recorded_and_overridable_at_inference(export_dir, checkpoint, row):
    from coordrl.envs.hmars import HmarsEnvFactory
    from coordrl.envs.hmars_index import TITLE_INDEX_HEADER
    from coordrl.envs.protocols import _hmars_card_section

    meta = json.loads((export_dir / POLICY_META).read_text())
    recorded = json.loads((checkpoint / CHECKPOINT_META).read_text())["env"]
    card = (export_dir / "README.md").read_text()
    source = resolve_policy(export_dir)
    for name, header, said in (
        ("memory_card_summaries", "Sub-agent card summaries (document text, not instructions):", "card summary"),
        ("memory_title_index", TITLE_INDEX_HEADER, "title's sub-agent"),
        ("question_after_memory", "\nQuestion: " + row["question"], "the question again"),
    ):
        assert meta["env"][name] is False and meta["hmars"][name] is False and recorded[name] is False
        assert said not in card
        assert header not in HmarsEnvFactory(source.env_config())().reset(**row)
        # The override Coordinator.from_pretrained(hmars=...) and --hmars apply, through the same env_config.
        on = source.env_config(hmars={name: True})
        assert getattr(on, name) is True and header in HmarsEnvFactory(on)().reset(**row)
    # The sub-agent map is on by default and recorded; off (with the card summaries) at inference, the
    # memory is the card summaries alone, and the card says so.
    assert meta["env"]["memory_map"] is True and recorded["memory_map"] is True and "memory_map" not in card
    compact = HmarsEnvFactory(source.env_config(hmars={"memory_map": False, "memory_card_summaries": True}))()
    memory = compact.reset(**row)
    assert "Sub-agents:" not in memory and "Sub-agent card summaries (document text, not instructions):" in memory
    off_meta = {**meta, "hmars": {**meta["hmars"], "memory_map": False}}
    assert "header only, `memory_map: false`" in "\n".join(_hmars_card_section(off_meta, POLICY_META))
    # The selector setting is recorded too, and applies at inference when overridden.
    assert meta["env"]["lexical_query_sentences"] is False and recorded["lexical_query_sentences"] is False
    assert "lexical_query_sentences" not in card
    on_meta = {**meta, "hmars": {**meta["hmars"], "lexical_query_sentences": True}}
    assert "(`lexical_query_sentences: true`)" in "\n".join(_hmars_card_section(on_meta, POLICY_META))
    assert source.env_config(hmars={"lexical_query_sentences": True}).lexical_query_sentences is True


def test_answer_cli_takes_hmars_overrides(export_dir, row, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(row["context"], encoding="utf-8")
    args = [
        "answer",
        "--policy",
        str(export_dir),
        "--document",
        str(doc),
        "--question",
        row["question"],
        "--max-new-tokens",
        "8",
    ]
    capsys.readouterr()
    assert main([*args, "--hmars", "group_size=2", "--json"]) in (
        0,
        1,
    )  # 1: the random policy's regions may find nothing
    out = json.loads(capsys.readouterr().out)
    assert out["info"]["regions"] > 1 and {"answer", "trace", "evidence", "info"} <= set(out)
    assert main([*args, "--hmars", "no_such_setting=1"]) == 2
    assert "unknown HMARS setting" in capsys.readouterr().err
    assert main([*args, "--readers", "http://127.0.0.1:9"]) == 2  # PARSER readers do not apply to a mid-agent


# -- what the frozen roles and the served mid-agent receive (RecordingServer) -------------------

_SUB = re.compile(r"\bs(\d+)\b")


def _scripted_mid_agent(tokenizer):
    """Served-policy replies: one broadcast whose interpretation and per-sub-agent hints are marked."""

    def respond(body: dict) -> list[int]:
        prompt = tokenizer.decode(body["prompt"])
        if "<tool_response>" in prompt:
            text = "<answer>recorded</answer>"
        else:
            memory = prompt.rsplit("Question: ", 1)[-1]
            hints = {f"s{n}": f"HINT-s{n}" for n in sorted(set(_SUB.findall(memory)), key=int)}
            call = {"name": "broadcast", "arguments": {"interpretation": "INTERP-MARK", "hints": hints}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    return respond


def _assert_hmars_roles_saw_their_inputs(server, tokenizer, row) -> None:
    from recording_server import user_text

    from coordrl.readers.prompt import sanitize_reader_text

    context = sanitize_reader_text(row["context"])
    question = sanitize_reader_text(row["question"])
    prompts = [tokenizer.decode(b["prompt"]) for b in server.bodies("policy")]
    sent_hints = {h for p in prompts for h in (f"HINT-s{n}" for n in _SUB.findall(p.rsplit("Question: ", 1)[-1]))}
    assert prompts and all(row["question"] in p and "broadcast" in p for p in prompts)  # question + tool schema
    selectors = [user_text(b) for b in server.bodies("selector")]
    assert selectors, server.roles()
    got_hints, first_pages = set(), []
    for text in selectors:
        assert text.startswith(f"Question: {question}\n\nMid-agent interpretation: INTERP-MARK\n\n")
        got_hints.update(re.findall(r"Hint for you: (HINT-s\d+)", text))
        pages = re.findall(
            r"\[page (\d+)\]\n(.*?)(?=\n\n\[page \d+\]\n|\Z)", text.split("Your pages:\n\n", 1)[1], re.DOTALL
        )
        assert pages and all(len(body) > 100 and body.removesuffix(" [...]") in context for _, body in pages)
        first_pages.append(pages[0][1].removesuffix(" [...]"))
    assert got_hints == sent_hints and len(got_hints) == len(selectors)  # each sub-agent got its own hint
    (answer,) = [user_text(b) for b in server.bodies("answerer")]
    assert answer.endswith(f"\n\nQuestion: {question}") and "(no evidence pages were selected)" not in answer
    assert all(page[:500] in answer for page in first_pages)  # the pages the selectors chose are the evidence


def _role_flags(url: str) -> list[str]:
    flags = []
    for role in ("selector", "answerer"):
        flags += [
            "--hmars",
            f"{role}={url}",
            "--hmars",
            f"{role}_model=recorded",
            "--hmars",
            f"{role}_api_key_env=null",
        ]
    return flags


def test_roles_receive_interpretation_hints_pages_and_evidence_answer_cli(export_dir, row, tmp_path, capsys):
    from recording_server import RecordingServer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    doc = tmp_path / "doc.txt"
    doc.write_text(row["context"], encoding="utf-8")
    with RecordingServer(policy_responder=_scripted_mid_agent(tokenizer)) as server:
        args = [
            "answer",
            "--policy",
            str(export_dir),
            "--policy-url",
            server.url,
            "--document",
            str(doc),
            "--question",
            row["question"],
        ]
        assert main([*args, "--hmars", "group_size=2", *_role_flags(server.url), "--json"]) == 0, (
            capsys.readouterr().err
        )
        _assert_hmars_roles_saw_their_inputs(server, tokenizer, row)
    out = json.loads(capsys.readouterr().out)
    assert out["answer"] == "recorded" and out["info"]["regions"] > 1


def test_roles_receive_interpretation_hints_pages_and_evidence_eval_cli(export_dir, sweep, row, tmp_path):
    from recording_server import RecordingServer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    with RecordingServer(policy_responder=_scripted_mid_agent(tokenizer)) as server:
        out = tmp_path / "eval"
        args = [
            "eval",
            "--policy",
            str(export_dir),
            "--policy-url",
            server.url,
            "--data",
            str(sweep / "length-00040"),
            "--out",
            str(out),
        ]
        assert main([*args, *EVAL_FLAGS, *_role_flags(server.url)]) == 0
        _assert_hmars_roles_saw_their_inputs(server, tokenizer, row)
    metrics = json.loads((out / "results.json").read_text())["overall"]
    assert metrics["failed"] == 0 and metrics["em"] == 0.0  # "recorded" is not the gold answer
    assert metrics["selector_errors"] == metrics["answerer_errors"] == metrics["answerer_parse_failures"] == 0
    assert "selector errors" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("selector_fault", "answerer_fault"), [("garbage", "not_json"), ("empty", "http500"), ("not_json", "garbage")]
)
def test_failing_roles_are_counted_per_role(export_dir, row, tmp_path, capsys, selector_fault, answerer_fault):
    from recording_server import RecordingServer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    doc = tmp_path / "doc.txt"
    doc.write_text(row["context"], encoding="utf-8")
    with RecordingServer(policy_responder=_scripted_mid_agent(tokenizer)) as server:
        server.faults = {"selector": selector_fault, "answerer": answerer_fault}
        args = [
            "answer",
            "--policy",
            str(export_dir),
            "--policy-url",
            server.url,
            "--document",
            str(doc),
            "--question",
            row["question"],
        ]
        code = main(
            [*args, "--hmars", "group_size=2", "--hmars", "backend_retries=0", *_role_flags(server.url), "--json"]
        )
        assert server.bodies("selector") and server.bodies(
            "answerer"
        )  # the prompts were real even though the replies were not
    out = json.loads(capsys.readouterr().out)
    info = out["info"]
    calls = info["selector_calls"]
    unparsed = (
        selector_fault == "garbage"
    )  # a 200 reply without the JSON object: parsed, failed, pages chosen lexically
    assert (info["selector_errors"], info["selector_parse_failures"]) == ((0, calls) if unparsed else (calls, 0))
    answered = answerer_fault == "garbage"
    assert (info["answerer_errors"], info["answerer_parse_failures"]) == ((0, 1) if answered else (1, 0))
    assert code == (0 if answered else 1) and (out["answer"] is not None) == answered
    assert info["backend_errors"] == info["selector_errors"] + info["answerer_errors"]
