"""Tests for the tiny offline Qwen3 tokenizer and model (coordrl.rollout.tiny_qwen3)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_stop_token_trained,
    parse_response,
    qwen3_chat_template,
    qwen3_training_chat_template,
)

from coordrl.data.tokenizer import (
    ADDED_TOKENS,
    SPECIAL_TOKENS,
    load_shipped_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

# Small enough to build in well under a second, but head_dim stays at the vLLM-compatible 64.
TINY_SHAPE = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=128)

QUERY_TOOL = {
    "type": "function",
    "function": {
        "name": "query_agents",
        "description": "Ask the reader agents.",
        "parameters": {
            "type": "object",
            "properties": {"queries": {"type": "array", "items": {"type": "string"}}},
            "required": ["queries"],
        },
    },
}

ROUND_TRIP_TEXTS = [
    '{"name": "query_agents", "arguments": {"queries": ["a"]}}',
    '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["Who directed \\"Ed Wood\\"?", ""]}}'
    "\n</tool_call>",
    "Fernando Fernán-Gómez (28 August 1921 – 21 November 2007)",
    "Little Rock–North Little Rock–Conway, Ålesund, naïve café, 東京, 😀",
    "line one\nline two\r\n\n\ttabbed   spaced  \n",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
    "e\u0301 vs \u00e9",  # decomposed and composed forms must both survive (no NFC normaliser)
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_shipped_tokenizer()


@pytest.fixture(scope="module")
def small_trained_tokenizer():
    texts = ["The quick brown fox jumps over the lazy dog.", '{"name": "query_agents", "arguments": {}}'] * 20
    return train_tokenizer(texts, vocab_size=400)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_exact_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_shipped_tokenizer_shape(tokenizer):
    assert len(tokenizer) == 8192
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    # JSON tool calls should cost few tokens: the shipped corpus includes tool-calling text for that reason.
    call = '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["a"]}}\n</tool_call>'
    assert len(tokenizer(call, add_special_tokens=False)["input_ids"]) <= 24


@pytest.mark.parametrize("token", SPECIAL_TOKENS + ADDED_TOKENS)
def test_marker_tokens_are_single_ids(tokenizer, token):
    ids = tokenizer(f"x{token}y", add_special_tokens=False)["input_ids"]
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert token_id in ids
    assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]


def test_special_flags_match_qwen3(tokenizer):
    # Qwen3 marks only the chat delimiters as special; tool/think markers must survive skip_special_tokens,
    # which TRL uses when it falls back to plain-text decoding.
    text = "<|im_start|><tool_call>a</tool_call><think>b</think><|im_end|>"
    decoded = tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)
    assert decoded == "<tool_call>a</tool_call><think>b</think>"


def test_chat_template_identity_and_trl_detection(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.chat_template == qwen3_chat_template
    assert get_training_chat_template(reloaded) == qwen3_training_chat_template
    assert is_chat_template_stop_token_trained(reloaded, qwen3_training_chat_template)
    add_response_schema(reloaded)  # raises ValueError for an unrecognised template
    assert getattr(reloaded, "response_template", None) is not None or reloaded.response_schema is not None


def test_trained_tokenizer_is_deterministic(small_trained_tokenizer, tmp_path):
    texts = ['{"name": "query_agents", "arguments": {}}', "The quick brown fox jumps over the lazy dog."] * 20
    other = train_tokenizer(reversed(texts), vocab_size=400)
    save_tokenizer(small_trained_tokenizer, tmp_path / "a")
    save_tokenizer(other, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert reloaded.chat_template == qwen3_chat_template
    for text in ROUND_TRIP_TEXTS:
        assert reloaded.decode(reloaded(text, add_special_tokens=False)["input_ids"]) == text


def test_trl_parse_response_extracts_tool_call(tokenizer):
    tok = add_response_schema(load_shipped_tokenizer())
    messages = [{"role": "user", "content": "Who directed Ed Wood?"}]
    # GRPOTrainer passes the rendered prompt ids as `prefix`; recent transformers require it.
    prompt_ids = tok.apply_chat_template(
        messages, tools=[QUERY_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    generated = (
        '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["Who directed Ed Wood?", "Tim Burton"]}}'
        "\n</tool_call><|im_end|>"
    )
    completion_ids = tok(generated, add_special_tokens=False)["input_ids"]
    parsed = parse_response(tok, completion_ids, prefix=prompt_ids, tools=[QUERY_TOOL])
    assert parsed["role"] == "assistant"
    assert parsed["content"] == ""
    assert parsed["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "query_agents", "arguments": {"queries": ["Who directed Ed Wood?", "Tim Burton"]}},
        }
    ]

    # Malformed JSON must degrade to plain content, not crash.
    broken = tok('<tool_call>\n{"name": "query_agents", "argu</tool_call><|im_end|>', add_special_tokens=False)
    parsed = parse_response(tok, broken["input_ids"], prefix=prompt_ids, tools=[QUERY_TOOL])
    assert "tool_calls" not in parsed
    assert parsed["content"].startswith("<tool_call>")


def test_tool_turn_renders_with_training_template(tokenizer):
    messages = [
        {"role": "user", "content": "Who?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "query_agents", "arguments": {"queries": ["a"]}}}],
        },
        {"role": "tool", "name": "query_agents", "content": json.dumps(["Tim Burton"])},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[QUERY_TOOL], chat_template=qwen3_training_chat_template, tokenize=False
    )
    assert '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["a"]}}\n</tool_call>' in text
    assert '<tool_response>\n["Tim Burton"]\n</tool_response>' in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_build_tiny_model_loads_and_generates(tokenizer, tmp_path):
    out = build_tiny_qwen3(tmp_path / "model", tokenizer=tokenizer, seed=0, **TINY_SHAPE)
    assert out == tmp_path / "model"
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True
    assert config["head_dim"] == 64
    assert config["vocab_size"] == len(tokenizer)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")

    model = AutoModelForCausalLM.from_pretrained(out)
    loaded_tok = AutoTokenizer.from_pretrained(out)
    assert loaded_tok.chat_template == qwen3_chat_template
    assert next(model.parameters()).dtype == torch.float32
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    prompt = loaded_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    new_tokens = generated[0, prompt["input_ids"].shape[1] :]
    assert 1 <= len(new_tokens) <= 4
    assert isinstance(loaded_tok.decode(new_tokens), str)


def test_same_seed_gives_identical_weights(tokenizer, tmp_path):
    a = build_tiny_qwen3(tmp_path / "a", tokenizer=tokenizer, seed=3, **TINY_SHAPE)
    b = build_tiny_qwen3(tmp_path / "b", tokenizer=tokenizer, seed=3, **TINY_SHAPE)
    c = build_tiny_qwen3(tmp_path / "c", tokenizer=tokenizer, seed=4, **TINY_SHAPE)
    weights = lambda d: (Path(d) / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(a) == weights(b)
    assert weights(a) != weights(c)


def test_default_tokenizer_is_shipped(tmp_path):
    out = build_tiny_qwen3(tmp_path / "m", **TINY_SHAPE)
    shipped = load_shipped_tokenizer()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == shipped.get_vocab()


def test_shipped_tokenizer_loads_from_a_zip(monkeypatch, tmp_path):
    # Installed as a zipped package, the resource is not a real directory; the loader must copy it out.
    import zipfile

    import coordrl.data.tokenizer as tiny

    shipped_dir = Path(tiny.__file__).resolve().parent.parent / "resources" / "tokenizer"
    archive = tmp_path / "tok.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in shipped_dir.iterdir():
            zf.write(path, f"tokenizer/{path.name}")
    monkeypatch.setattr(tiny, "_resource_dir", lambda *parts: zipfile.Path(archive, "tokenizer/"))
    loaded = tiny.load_shipped_tokenizer()
    assert len(loaded) == 8192
    assert loaded.chat_template == qwen3_chat_template


@pytest.mark.slow
def test_shipped_tokenizer_is_reproducible(tmp_path):
    # The committed tokenizer must be exactly what build_shipped_tokenizer() produces (about 6 s).
    import coordrl.data.tokenizer as tiny

    shipped_dir = Path(tiny.__file__).resolve().parent.parent / "resources" / "tokenizer"
    rebuilt = tiny.build_shipped_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (rebuilt / name).read_bytes() == (shipped_dir / name).read_bytes(), name
