"""The real reader stack: OpenAIReaderFleet against a vLLM CPU server started by serve.py's CPU mode.

Needs ``.venv-vllm`` (``scripts/setup_vllm_cpu.sh``; or an interpreter with vllm in
``$COORDRL_VLLM_PYTHON``). The model is the tiny random Qwen3 from ``build_tiny_qwen3``: answers are
gibberish, which is fine: the tests check transport, prefix caching, the HMARS selector role and fault
recovery, not quality. One server start for the module (about 50 s on 2 cores with ``--enforce-eager``)
plus one restart in the outage test, which runs last.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from vllm_cpu import free_port, vllm_python_or_skip

from coordrl.data import BuildConfig, build_dataset
from coordrl.data.chunk import chunk_context
from coordrl.data.layout import render_context
from coordrl.data.records import load_records
from coordrl.data.show import load_built
from coordrl.data.tokenizer import load_shipped_tokenizer
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.hmars import HmarsEnvConfig, HmarsEnvFactory
from coordrl.readers.base import ReaderRequest
from coordrl.readers.openai_fleet import OpenAIReaderFleet, health
from coordrl.readers.serve import prefix_cache_counters, start_reader_servers
from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 2048
# Chunks this long leave room for the instructions, the question and the answer within
# MAX_MODEL_LEN, and make the shared prefix dominate each prompt.
CHUNK_TOKENS = 1750
ANSWER_TOKENS = 16


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return vllm_python_or_skip()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), seed=0))


@pytest.fixture(scope="module")
def server(vllm_python, model_dir, tmp_path_factory):
    group = start_reader_servers(
        model_dir,
        cpu=True,
        port_base=free_port(),
        python=vllm_python,
        max_model_len=MAX_MODEL_LEN,
        cpu_memory_fraction=0.15,
        # Eager mode halves the start (no torch.compile warm-up); speed is irrelevant here.
        extra_args=["--enforce-eager"],
        startup_timeout_s=400,
        log_dir=tmp_path_factory.mktemp("reader-logs"),
    )
    with group:
        yield group.servers[0]


@pytest.fixture(scope="module")
def chunks() -> list[str]:
    """Real HotpotQA text, cut into CHUNK_TOKENS-token chunks with the model's own tokenizer."""
    records, _ = load_records("sample", "hotpotqa")
    paragraphs = [p for record in records[:12] for p in record.paragraphs]
    context, offsets = render_context(paragraphs)
    found = chunk_context(context, load_shipped_tokenizer(), CHUNK_TOKENS, offsets)
    assert len(found) >= 5
    return [c.text for c in found[:4]]


def _fleet(server, model_dir, **kw) -> OpenAIReaderFleet:
    kw.setdefault("max_tokens", ANSWER_TOKENS)
    kw.setdefault("api_key_env", None)
    # min_tokens: a random model may emit EOS first; the test wants text to check.
    kw.setdefault("extra_body", {"min_tokens": 4})
    return OpenAIReaderFleet([server.url], model_dir, **kw)


async def _answer(fleet: OpenAIReaderFleet, requests: list[ReaderRequest]):
    try:
        return await fleet.answer(requests)
    finally:
        await fleet.aclose()


def _requests(chunks: list[str], queries: list[str]) -> list[ReaderRequest]:
    return [ReaderRequest(q, c, f"chunk{i}") for q in queries for i, c in enumerate(chunks)]


def test_fleet_gets_answers_from_the_real_server(server, model_dir, chunks):
    assert asyncio.run(health(server.url))
    requests = _requests(chunks, ["Who directed Doctor Strange?", "When was Ed Wood born?"])
    results = asyncio.run(_answer(_fleet(server, model_dir), requests))
    assert len(results) == len(requests)
    for r in results:
        assert r.ok, r.error
        assert r.text.strip()
        assert r.latency_s > 0 and r.attempts == 1
        assert "<tool_call>" not in r.text and "<|im_end|>" not in r.text


def test_prefix_cache_serves_repeated_queries_over_the_same_chunks(server, model_dir, chunks):
    fleet = _fleet(server, model_dir)
    # Cold phase: one query per chunk computes (and caches) each chunk's prefix.
    asyncio.run(_answer(fleet, _requests(chunks, ["What nationality was Scott Derrickson?"])))
    q0, h0 = prefix_cache_counters(server.url)
    # Repeated phase: new questions over the same chunks reuse everything before the question.
    queries = ["Who is Tyler Bates?", "Where is Woodson, Arkansas?", "What is Sinister about?"]
    results = asyncio.run(_answer(fleet, _requests(chunks, queries)))
    assert all(r.ok for r in results)
    q1, h1 = prefix_cache_counters(server.url)
    hit_rate = (h1 - h0) / (q1 - q0)
    print(f"prefix cache hit rate, repeated phase: {hit_rate:.3f} ({h1 - h0:.0f}/{q1 - q0:.0f} tokens)")
    assert q1 - q0 > len(results) * CHUNK_TOKENS * 0.9  # the counters really cover the phase
    assert hit_rate >= 0.90


def test_rollout_cli_episode_against_the_real_reader_server(server, model_dir, tmp_path, capsys):
    """`coordrl rollout` with vLLM readers: the newcomer's path from the README."""
    import json

    from coordrl.cli import main
    from coordrl.data import BuildConfig, build_dataset

    data = tmp_path / "ds"
    build_dataset(BuildConfig(seed=0, num_samples=1, num_paragraphs=12), data)
    rc = main(
        [
            "rollout",
            "--data",
            str(data),
            "--readers",
            server.url,
            "--reader-model",
            model_dir,
            "--chunk-tokens",
            "512",
            "--json",
        ]
    )
    assert rc == 0
    episode = json.loads(capsys.readouterr().out)
    info = episode["info"]
    assert info["reader_calls"] == info["chunks"] >= 2 and info["reader_errors"] == 0
    tool_message = next(m for m in episode["messages"] if m["role"] == "tool")
    assert "readers for 1 query" in tool_message["content"]


def test_hmars_selector_role_on_the_real_server(server, model_dir, tmp_path):
    # Sample 0 at 200 paragraphs: "Were Scott Derrickson and Ed Wood of the same nationality?", gold
    # Documents on s5 and s1 with 512-token pages and 4,096-token sub-agents (8 sub-agents).
    build_dataset(BuildConfig(num_samples=2, num_paragraphs=200), tmp_path / "ds")
    row = dict(load_built(tmp_path / "ds")[0])
    hints = {"s1": "Ed Wood American filmmaker", "s5": "Scott Derrickson American director"}
    # Short page excerpts keep every selector prompt inside the tiny server's 2,048-token context.
    config = HmarsEnvConfig(
        c_sub=4096, page_tokens=512, selector=server.url, selector_model=model_dir, selector_api_key_env=None,
        selector_max_tokens=16, selector_page_chars=250,
    )  # fmt: skip
    factory = HmarsEnvFactory(config, tokenizer=load_tokenizer(None))
    try:
        env = factory()
        env.reset(**row)
        obs = asyncio.run(env.broadcast("Nationalities of Scott Derrickson and Ed Wood", hints))
        info = env.info
    finally:
        factory.close()
    # Every sub-agent's selection went to the server; the random model's replies are not JSON, so each
    # fell back to lexical selection and was counted as a parse failure, never an error to the policy.
    assert info["endpoint_calls"] == info["participants"] == 8 and info["backend_errors"] == 0, obs
    assert info["parse_failures"] == 8 and info["recall"] == 1.0 and "Answer: " in obs


def test_server_killed_mid_batch_then_restarted(server, model_dir, chunks):
    """Runs last: it kills and restarts the module's server."""
    # Short prompts and 512 forced answer tokens: the batch takes seconds, so the kill lands mid-batch.
    fleet = _fleet(
        server, model_dir, max_tokens=512, timeout_s=60, max_retries=2, backoff_s=0.2,
        extra_body={"min_tokens": 512, "ignore_eos": True},
    )  # fmt: skip
    batch = _requests([c[:1500] for c in chunks], [f"Question number {i}?" for i in range(4)])

    async def batch_with_crash():
        asyncio.get_running_loop().call_later(0.5, server.kill)
        return await _answer(fleet, batch)

    results = asyncio.run(batch_with_crash())  # must not raise
    assert len(results) == len(batch)
    failed = [r for r in results if not r.ok]
    assert failed, "the kill should have hit requests in flight"
    assert all(r.attempts == 3 and r.text == "" and r.error for r in failed)

    during_outage = asyncio.run(_answer(fleet, batch[:4]))  # nothing listens now
    assert all(not r.ok and r.attempts == 3 and "Connect" in r.error for r in during_outage)

    server.start()
    server.wait_healthy(timeout_s=400)
    after = asyncio.run(_answer(_fleet(server, model_dir, max_retries=2, backoff_s=0.2), batch[:4]))
    assert all(r.ok and r.text.strip() for r in after), [r.error for r in after]
