"""The ``chunk_overlap_tokens`` setting: validated, plumbed into the PARSER environment, findings placed."""

import json
from pathlib import Path

import pytest

from coordrl.data.chunk import chunk_context
from coordrl.data.errors import ConfigError
from coordrl.data.layout import Paragraph, render_context
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.chat import ChatCodec
from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory
from coordrl.envs.protocols import get_protocol
from coordrl.envs.step import StepEnv
from coordrl.train.config import load_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
FACT = "Zorblat Quell was born in the harbour city of Vandrimar in 1871."
QUERY = "Where was Zorblat Quell born?"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _row(tok, size):
    """A document whose one fact straddles the third tiling boundary at ``size``-token chunks."""
    filler = [
        Paragraph(f"Mill {i}", f"The mill number {i} grinds grain for the village every week.") for i in range(40)
    ]
    context, _ = render_context(filler)
    boundary = chunk_context(context, tok, size)[3].char_start
    cut = context.rfind(" ", 0, boundary - 8)
    context = context[:cut] + " " + FACT + context[cut:]
    return {"id": "q", "question": QUERY, "answers": ["Vandrimar"], "context": context, "gold_documents": []}


def _ask(tok, row, **cfg):
    factory = ParserEnvFactory(ParserEnvConfig(**cfg), tokenizer=tok)
    env = StepEnv(factory(), ChatCodec(tok), max_turns=3)
    env.reset(**row)
    call = {"name": "query_agents", "arguments": {"queries": [QUERY, "Which mill grinds grain?"]}}
    env.step("<tool_call>\n" + json.dumps(call) + "\n</tool_call>")
    return env.env


@pytest.mark.parametrize(
    "settings",
    [
        {"chunk_tokens": 64, "chunk_overlap_tokens": 64},
        {"chunk_tokens": 64, "chunk_overlap_tokens": 200},
        {"chunk_overlap_tokens": -1},
        {"chunk_overlap_tokens": True},
        {"chunk_overlap_tokens": 1.5},
    ],
)
def test_overlap_outside_0_to_chunk_tokens_is_refused_naming_the_setting(settings):
    with pytest.raises(ConfigError, match=r"^chunk_overlap_tokens: must be a whole number >= 0 and below chunk_tokens"):
        ParserEnvConfig(**settings)


def test_train_config_and_recorded_policy_settings_carry_the_overlap():
    cfg = load_config(TINY, {"chunk_overlap_tokens": "48"})
    env = cfg.env_config()
    assert env.chunk_overlap_tokens == 48 and env.to_dict()["chunk_overlap_tokens"] == 48
    with pytest.raises(ConfigError, match="chunk_overlap_tokens"):
        load_config(TINY, {"chunk_overlap_tokens": "512"})  # tiny_cpu's chunks are 512 tokens
    # Evaluation and inference: the recorded overlap stays unless replaced; HMARS refuses it.
    parser = get_protocol("parser")
    recorded = env.to_dict()
    kept = parser.config(recorded, **parser.eval_settings(None, None, None, None))
    assert (kept.chunk_tokens, kept.chunk_overlap_tokens) == (4096, 48)
    replaced = parser.config(recorded, **parser.eval_settings(None, None, None, 1024, 0))
    assert (replaced.chunk_tokens, replaced.chunk_overlap_tokens) == (1024, 0)
    with pytest.raises(ValueError, match="chunk_overlap_tokens"):
        get_protocol("hmars").eval_settings(None, None, None, None, 16)


def test_overlap_zero_gives_todays_chunks(tok):
    row = _row(tok, 64)
    env = _ask(tok, row, chunk_tokens=64)
    assert env.chunks == chunk_context(row["context"], tok, 64)
    assert "".join(c.text for c in env.chunks) == row["context"]


def test_a_boundary_fact_is_read_whole_and_findings_say_where(tok):
    row = _row(tok, 64)
    tiled = _ask(tok, row, chunk_tokens=64)
    assert not any("Vandrimar" in f["text"] and "Zorblat" in f["text"] for f in tiled.findings)
    env = _ask(tok, row, chunk_tokens=64, chunk_overlap_tokens=24)
    chunks = env.chunks
    assert chunks == chunk_context(row["context"], tok, 64, overlap_tokens=24)
    whole = [f for f in env.findings if FACT in f["text"]]
    assert whole, "no reader saw the boundary fact whole"
    for f in env.findings:
        c = chunks[f["chunk"]]
        assert (f["token_start"], f["token_end"], f["documents"]) == (c.token_start, c.token_end, list(c.documents))
    # A stable order: turn, then query, then position in the document.
    order = [(f["turn"], [QUERY, "Which mill grinds grain?"].index(f["query"]), f["token_start"]) for f in env.findings]
    assert order == sorted(order) and len({o[2] for o in order if o[1] == 1}) > 1
