"""The dense routing pathway against a real embeddings endpoint: vLLM's CPU build serving a tiny
Qwen3 with the pooling runner (``--runner pooling --convert embed``, last-token pooling).

The tiny model has random weights, so its embeddings carry no meaning; what they do carry is
identity: the same text embeds to the same vector, so a query that repeats a chunk's text is
closest to that chunk. The tests check the pathway's plumbing and ranking through the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from vllm_cpu import free_port, vllm_python_or_skip

from coordrl.data.records import load_records
from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory
from coordrl.readers.base import ReaderRequest, ReaderResult
from coordrl.readers.lexical import LexicalReader
from coordrl.readers.routing import ChunkRouter, EmbeddingClient, RouterSettings
from coordrl.readers.serve import start_reader_servers
from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    python = vllm_python_or_skip()
    model = str(build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-embed"), seed=0))
    group = start_reader_servers(
        model,
        cpu=True,
        port_base=free_port(),
        python=python,
        max_model_len=1024,
        cpu_memory_fraction=0.1,
        # The pooling runner turns the causal LM into an embedding model; eager mode starts faster.
        extra_args=["--runner", "pooling", "--convert", "embed", "--enforce-eager"],
        startup_timeout_s=400,
        log_dir=tmp_path_factory.mktemp("embed-logs"),
    )
    with group:
        yield group.servers[0].url, model


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    """Twelve real HotpotQA paragraphs, each short enough to be a query too (max_query_chars 500)."""
    records, _ = load_records("sample", "hotpotqa")
    texts = [f"{p.title}: {p.body}"[:480] for r in records[:3] for p in r.paragraphs]
    return texts[:12]


class RecordingReader(LexicalReader):
    def __init__(self) -> None:
        super().__init__(threshold=0.5)
        self.asked: list[tuple[str, str]] = []

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]:
        self.asked += [(r.query, r.chunk_text) for r in requests]
        return await super().answer(requests)


def test_embeddings_client_gets_unit_vectors_and_truncates_long_chunks(embed_server):
    url, model = embed_server
    client = EmbeddingClient(url, model)
    vectors = client.embed(["Shirley Temple was an actress.", "Shirley Temple was an actress.", "word " * 3000])
    assert vectors.shape[0] == 3 and vectors.shape[1] > 16
    assert vectors[0] @ vectors[1] == pytest.approx(1.0, abs=1e-5)  # same text, same vector
    assert (
        abs((vectors * vectors).sum(axis=1) - 1.0) < 1e-5
    ).all()  # a chunk past the context is truncated, not refused


def test_dense_pathway_wakes_the_chunk_the_server_finds_closest(embed_server, paragraphs):
    url, model = embed_server
    settings = RouterSettings(bm25_top_k=0, summary_top_k=0, dense_top_k=1, dense_url=url, dense_model=model)
    router = ChunkRouter(paragraphs, settings)
    for i in (0, 5, 11):
        assert router.route(paragraphs[i]).chunks == (i,)
    # Through the environment: dense-only routing, then dense beside BM25 (the union of both proposals).
    for bm25_k in (0, 2):
        cfg = ParserEnvConfig(
            activation="routed", route_bm25_top_k=bm25_k, route_summary_top_k=0, route_dense_top_k=1,
            route_dense_url=url, route_dense_model=model,
        )  # fmt: skip
        reader = RecordingReader()
        env = ParserEnvFactory(cfg, fleet=reader)()
        env.reset(question="q", answers=["a"], gold_documents=[], chunks=paragraphs)
        asyncio.run(env.query_agents([paragraphs[5]]))
        woke = [paragraphs.index(text) for _, text in reader.asked]
        expected = {5} | set(
            ChunkRouter(paragraphs, RouterSettings(bm25_top_k=2, summary_top_k=0)).route(paragraphs[5]).chunks
            if bm25_k
            else ()
        )
        assert woke == sorted(expected) and env.info["router_errors"] == 0
