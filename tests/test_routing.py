"""Reader activation: ``activation: routed`` wakes only the chunks the routing pathways propose.

Real parts throughout: packed HotpotQA samples, the shipped tokenizer, `bm25s` indexes and the
lexical reader, wrapped only to record what each reader was asked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

from coordrl.data import BuildConfig, build_dataset
from coordrl.data.errors import ConfigError
from coordrl.data.show import load_built
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.chat import ChatCodec, env_tools
from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory, ParserLeadEnv, RoutedParserLeadEnv
from coordrl.envs.step import StepEnv
from coordrl.readers.base import ReaderRequest, ReaderResult
from coordrl.readers.lexical import LexicalReader
from coordrl.readers.prompt import READER_INSTRUCTIONS
from coordrl.readers.routing import ChunkRouter, RouterCache, RouterSettings, chunk_summaries, document_key

ROUTED = {"activation": "routed", "route_bm25_top_k": 3, "route_summary_top_k": 3}


class RecordingReader(LexicalReader):
    """The lexical reader, remembering every (query, chunk text) it was asked."""

    def __init__(self) -> None:
        super().__init__(threshold=0.5)
        self.asked: list[tuple[str, str]] = []

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]:
        self.asked += [(r.query, r.chunk_text) for r in requests]
        return await super().answer(requests)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("routing") / "ds"
    build_dataset(BuildConfig(seed=0, num_samples=4, num_paragraphs=200), out)
    return out


@pytest.fixture(scope="module")
def samples(built):
    return load_built(built)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def make(tok, **cfg):
    reader = RecordingReader()
    factory = ParserEnvFactory(ParserEnvConfig(**cfg), fleet=reader, tokenizer=tok)
    return factory, reader


def ask(env, queries):
    return asyncio.run(env.query_agents(queries))


QUERIES = ["What is the nationality of Scott Derrickson?", "What nationality was Ed Wood?"]


def test_routed_queries_reach_only_the_activated_readers(samples, tok):
    row = samples[0]  # "Were Scott Derrickson and Ed Wood of the same nationality?"
    factory, reader = make(tok, **ROUTED)
    env = factory()
    env.reset(**row)
    obs = ask(env, QUERIES)
    texts = [c.text for c in env.chunks]
    router = ChunkRouter(texts, RouterSettings(bm25_top_k=3, summary_top_k=3))
    routes = [router.route(q).chunks for q in QUERIES]
    assert reader.asked == [(q, texts[i]) for q, idx in zip(QUERIES, routes) for i in idx]
    assert all(0 < len(idx) <= 6 for idx in routes) and len(texts) > 40  # about 55 chunks of 512 tokens
    info = env.info
    assert info["reader_calls"] == len(reader.asked) < len(QUERIES) * len(texts)
    assert info["activated_chunks_per_query"] == len(reader.asked) / 2
    assert info["gold_activation_recall"] == 1.0 and info["gold_coverage"] == 1.0
    assert "American" in obs and f"from {len(set(routes[0]) | set(routes[1]))} readers for 2 query(ies)" in obs
    assert {f["chunk"] for f in env.findings} <= set(routes[0]) | set(routes[1])


def test_all_broadcasts_to_every_reader_as_before(samples, tok):
    row = samples[0]
    observations = []
    for cfg in ({}, {"activation": "all"}):
        factory, reader = make(tok, **cfg)
        env = factory()
        env.reset(**row)
        observations.append(ask(env, QUERIES))
        texts = [c.text for c in env.chunks]
        assert reader.asked == [(q, t) for q in QUERIES for t in texts]
        info = env.info
        assert info["activated_chunks_per_query"] == len(texts) and info["gold_activation_recall"] == 1.0
        assert info["router_ms_per_query"] == 0.0 and factory.router_cache.builds == 0
    assert observations[0] == observations[1]
    assert observations[0].startswith(f"{observations[0].split()[0]} finding(s) from {len(texts)} readers for 2")


@pytest.mark.parametrize(
    ("switch", "pathway"), [({"route_bm25_top_k": 0}, "summary"), ({"route_summary_top_k": 0}, "bm25")]
)
def test_a_pathway_switched_off_proposes_nothing(samples, tok, switch, pathway):
    row = samples[1]
    factory, reader = make(tok, **{**ROUTED, **switch})
    env = factory()
    env.reset(**row)
    question = row["question"]
    ask(env, [question])
    texts = [c.text for c in env.chunks]
    both = ChunkRouter(texts, RouterSettings(bm25_top_k=3, summary_top_k=3)).route(question)
    assert set(both.by_pathway) == {"bm25", "summary"}
    assert reader.asked == [(question, texts[i]) for i in sorted(both.by_pathway[pathway])]
    # The ablation is not the union: the other pathway proposed something this one did not.
    assert set(both.chunks) != set(both.by_pathway[pathway])


def test_a_query_no_pathway_matches_wakes_no_reader(samples, tok):
    factory, reader = make(tok, **ROUTED)
    env = factory()
    env.reset(**samples[0])
    obs = ask(env, ["zxqv blorft"])
    assert reader.asked == [] and env.info["reader_calls"] == 0
    assert obs.startswith("0 finding(s) from 0 readers") and "no chunk matched this query's words" in obs


def test_routed_tool_inputs_are_still_checked(samples, tok):
    factory, reader = make(tok, **ROUTED)
    env = factory()
    env.reset(**samples[0])
    for bad in ("one string", [], ["ok", 3], ["x" * 501]):
        assert ask(env, bad).startswith("Error:")
    assert reader.asked == [] and env.info["tool_errors"] == 4 and factory.router_cache.builds == 0


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"activation": "broadcast"}, "activation: must be one of all, routed, got 'broadcast'"),
        ({"activation": "routed", "route_bm25_top_k": 0, "route_summary_top_k": 0}, "activation: routed needs"),
        ({"route_bm25_top_k": -1}, "route_bm25_top_k: must be a whole number >= 0"),
        ({"route_summary_top_k": 2.5}, "route_summary_top_k: must be a whole number"),
        ({"route_dense_top_k": True}, "route_dense_top_k: must be a whole number"),
        ({"activation": "routed", "route_dense_top_k": 4}, "route_dense_url: route_dense_top_k > 0 needs"),
        (
            {"activation": "routed", "route_dense_top_k": 4, "route_dense_url": "http://127.0.0.1:9"},
            "route_dense_model",
        ),
        ({"reader_cost_weight": -0.1}, "reader_cost_weight: must be >= 0"),
    ],
)
def test_bad_settings_are_errors_naming_the_setting(cfg, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParserEnvConfig(**cfg)


def test_train_config_carries_routing_into_checkpoint_export_and_inference(tmp_path):
    from coordrl.rollout.policy_source import PolicySource
    from coordrl.train.config import load_config
    from coordrl.train.run import checkpoint_metadata

    with pytest.raises(ConfigError, match="activation"):
        load_config(None, {"model": "m", "activation": "sometimes"})
    with pytest.raises(ConfigError, match="route_bm25_top_k"):
        load_config(None, {"model": "m", "route_bm25_top_k": "-3"})
    cfg = load_config(
        None, {"model": "m", "activation": "routed", "route_bm25_top_k": "5", "output_dir": str(tmp_path)}
    )
    env = checkpoint_metadata(cfg, "m")["env"]
    assert (env["activation"], env["route_bm25_top_k"], env["route_summary_top_k"]) == ("routed", 5, 8)
    json.dumps(env)  # recorded as JSON in checkpoints and exports
    for kind in ("checkpoint", "export"):
        config = PolicySource("p", kind, None, env=dict(env)).env_config(readers="lexical")
        assert (config.activation, config.route_bm25_top_k, config.chunk_tokens) == ("routed", 5, 4096)


def test_coordinator_answers_with_routed_readers(samples):
    from coordrl.inference.coordinator import Coordinator
    from coordrl.rollout.policy_source import load_policy, resolve_policy

    row = samples[0]
    source = resolve_policy("scripted")
    source.env.update(activation="routed", route_bm25_top_k=2, route_summary_top_k=2)
    config = source.env_config(readers="lexical", chunk_tokens=512)
    policy, tokenizer = load_policy(source)
    with Coordinator(policy, tokenizer, source, config) as coord:
        result = coord.answer(row["context"], "When was Scott Derrickson born?")
    assert any("1966" in e["text"] for e in result.evidence)
    assert result.info["reader_calls"] <= 4 < result.info["chunks"]


def test_episode_info_reports_reader_tokens_and_normalised_cost(samples, tok):
    row = samples[2]
    question = row["question"]
    call = (
        "<tool_call>\n" + json.dumps({"name": "query_agents", "arguments": {"queries": [question]}}) + "\n</tool_call>"
    )
    infos = {}
    for name, cfg in (("all", {}), ("routed", ROUTED)):
        factory, _ = make(tok, **cfg)
        env = StepEnv(factory(), ChatCodec(tok), max_turns=3)
        env.reset(**row)
        env.step(call)
        infos[name] = env.step("<answer>x</answer>").info
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    overhead = count(READER_INSTRUCTIONS) + count("Passage:\n\n\nQuestion: ") + count(question)
    full = infos["all"]
    # A broadcast's reader prompts: instructions and query once per chunk, plus every chunk's tokens once.
    assert full["reader_prompt_tokens"] == full["chunks"] * overhead + row["num_tokens"]
    routed = infos["routed"]
    assert 0 < routed["reader_prompt_tokens"] < full["reader_prompt_tokens"] / 5
    for info in (full, routed):
        assert info["lead_tokens"] > 0
        assert info["normalised_cost"] == pytest.approx(info["lead_tokens"] + 0.1 * info["reader_prompt_tokens"])
    assert full["lead_tokens"] == routed["lead_tokens"] or full["observation_tokens"] != routed["observation_tokens"]


@pytest.mark.parametrize("cache_entries", [256, 0])
def test_precomputed_chunks_count_reader_tokens_as_the_plain_count(tok, cache_entries):
    # Rows with ready-made chunks (the synthetic world's) carry no token spans: their chunk counts are
    # batched and shared between a factory's episodes, and must equal counting each request's prompt.
    from coordrl.envs.parser import ChunkCache

    chunks = ['He said "no" \\ then left.', "Ünïcödé text\twith\ncontrol", "A third chunk, longer than the others are."]
    row = {"id": "c", "question": "Who left?", "answers": ["he"], "chunks": chunks}
    queries = ["Who said no?", "Who left the room?"]
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    overhead = count(READER_INSTRUCTIONS) + count("Passage:\n\n\nQuestion: ")
    want = sum(overhead + count(q) + count(c) for q in queries for c in chunks)
    factory, _ = make(tok)
    factory.chunk_cache = ChunkCache(cache_entries)
    for _ in range(2):  # the second episode finds the counts cached (when caching is on)
        env = factory()
        env.reset(**row)
        ask(env, queries)
        assert env.info["reader_prompt_tokens"] == want


def test_index_is_built_once_per_document(samples, tok):
    factory, _ = make(tok, **ROUTED)
    for row in (samples[0], samples[0], samples[1], samples[0]):
        env = factory()
        env.reset(**row)
        ask(env, [row["question"], "Ed Wood"])
    assert (factory.router_cache.builds, factory.router_cache.hits) == (2, 2)
    # top-k is a query-time setting: an index built for one top-k serves another.
    cache = RouterCache()
    texts = [c.text for c in env.chunks]
    key = document_key(["a", "b"])
    first = cache.get(key, texts, RouterSettings(bm25_top_k=3, summary_top_k=3))
    assert cache.get(key, texts, RouterSettings(bm25_top_k=1, summary_top_k=5)) is first
    assert cache.get(key, texts, RouterSettings(bm25_top_k=3, summary_top_k=0)) is not first  # another index
    assert cache.builds == 2


def test_summaries_name_each_paragraph_and_carry_a_cut_title():
    chunks = [
        "Document 1:\nShirley Temple\nShirley Temple was an American actress. She",
        " later served as Chief of Protocol.\n\nDocument 2:\nKiss and Tell (1945 film)\nA comedy film. It starred Temple.",
    ]
    first, second = chunk_summaries(chunks)
    assert first.startswith("Shirley Temple Shirley Temple") and "American actress." in first
    assert second.startswith("Shirley Temple Kiss and Tell (1945 film)") and "A comedy film." in second
    # Plain text: blank-line paragraphs, a short first line is a heading; a cut paragraph has no heading to carry.
    plain = chunk_summaries(
        ["Risks\nThe Board of Directors met. The Board of Directors left.\n\nSales rose", " again."]
    )
    assert plain[0] == "Risks Risks The Board Directors The Board of Directors met. Sales rose" and plain[1] == "again."


def test_routing_is_deterministic_and_settings_are_checked():
    texts = [
        "Document 1:\nAlpha\nAlpha is a town.",
        "Document 2:\nBeta\nBeta is a town.",
        "Document 3:\nGamma\nA city.",
    ]
    router = ChunkRouter(texts, RouterSettings(bm25_top_k=1, summary_top_k=1))
    # "town" ties chunks 0 and 1: the earlier chunk wins, every time.
    assert router.route("town").chunks == (0,) and router.route("Beta town").chunks == (1,)
    assert router.route("nothing here").chunks == ()
    with pytest.raises(ValueError, match="at least one pathway"):
        RouterSettings(bm25_top_k=0, summary_top_k=0)
    with pytest.raises(ValueError, match="built without the summary pathway"):
        ChunkRouter(texts, RouterSettings(bm25_top_k=1, summary_top_k=0)).route("x", RouterSettings(summary_top_k=1))


def test_eval_averages_and_tabulates_the_activation_metrics():
    from coordrl.eval.metrics import aggregate
    from coordrl.eval.report import render_results_md

    info = {"turns": 1, "queries": 2, "reader_calls": 10, "activated_chunks_per_query": 5.0}
    records = [
        {"status": "ok", "scores": {m: 1.0 for m in ("sub_em", "guarded_sub_em", "em", "f1")}, "prediction": "x",
         "info": {**info, "gold_activation_recall": recall, "reader_prompt_tokens": 1000, "normalised_cost": cost}}
        for recall, cost in ((1.0, 300.0), (0.5, 500.0))
    ]  # fmt: skip
    metrics = aggregate(records)
    assert metrics["gold_activation_recall"] == 0.75 and metrics["normalised_cost"] == 400.0
    assert metrics["activated_chunks_per_query"] == 5.0 and metrics["reader_prompt_tokens"] == 1000.0
    results = {
        "label": "p", "policy": {"spec": "p", "kind": "export"}, "data": "d", "protocol": "parser",
        "settings": {"readers": "lexical", "max_turns": 12, "chunk_tokens": 4096, "max_new_tokens": 8,
                     "temperature": 0.0, "seed": 0},
        "env": {**ParserEnvConfig(**ROUTED).to_dict()},
        "subsets": [{"name": "length-06400", "kind": "length", "paragraphs": 6400, "tokens_mean": 1e6,
                     "variant": "length=6400", "value": "6400", "metrics": metrics}],
        "overall": metrics,
    }  # fmt: skip
    md = render_results_md(results)
    assert "routed activation (bm25 top-3, summary top-3)" in md and "0.1 x reader prompt tokens" in md
    header = next(line for line in md.splitlines() if line.startswith("| paragraphs"))
    row = next(line for line in md.splitlines() if line.startswith("| 6,400"))
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["activated/query"] == "5.0" and cells["gold activation recall"] == "75.0"
    assert cells["normalised cost"] == "400" and cells["reader prompt tokens"] == "1,000"


def test_a_dead_embeddings_server_is_counted_and_never_hides_the_document(samples, tok):
    from vllm_cpu import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every request is refused
    dense = {"activation": "routed", "route_dense_url": dead, "route_dense_model": "m", "reader_timeout_s": 5.0}
    row = samples[0]
    # Dense alone: its failure must not hide the document, so the query goes to every reader.
    factory, reader = make(tok, **dense, route_bm25_top_k=0, route_summary_top_k=0, route_dense_top_k=2)
    env = factory()
    env.reset(**row)
    ask(env, [QUERIES[0]])
    assert len(reader.asked) == len(env.chunks) and env.info["router_errors"] == 1
    # Beside a lexical pathway: the lexical proposals stand, the failure is counted per query.
    factory, reader = make(tok, **dense, route_bm25_top_k=3, route_summary_top_k=0, route_dense_top_k=2)
    env = factory()
    env.reset(**row)
    ask(env, QUERIES)
    bm25 = ChunkRouter([c.text for c in env.chunks], RouterSettings(bm25_top_k=3, summary_top_k=0))
    assert reader.asked == [(q, env.chunks[i].text) for q in QUERIES for i in bm25.route(q).chunks]
    assert env.info["router_errors"] == 2


def test_dense_pathway_sends_chunks_then_the_query_over_one_connection():
    """What the embeddings server receives: every chunk text once (the index), then each query alone,
    all on one keep-alive connection shared by every document's router in the cache."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[dict] = []
    peers: set[tuple] = set()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append({"path": self.path, **body})
            peers.add(self.client_address)
            # One-hot vectors keyed by a word, so the query about "alpha" is nearest the alpha chunk.
            vecs = [[float("alpha" in t), float("beta" in t), 1e-3] for t in body["input"]]
            payload = json.dumps({"data": [{"index": i, "embedding": v} for i, v in enumerate(vecs)]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        settings = RouterSettings(bm25_top_k=0, summary_top_k=0, dense_top_k=1, dense_url=url, dense_model="emb")
        cache = RouterCache()
        texts = ["Document 1:\nalpha facts", "Document 2:\nbeta facts"]
        router = cache.get("doc-a", texts, settings)
        assert router.route("who is alpha").chunks == (0,)
        cache.get("doc-b", ["beta only", "alpha only"], settings).route("beta?")
        cache.close()
    finally:
        server.shutdown()
    assert [b["input"] for b in bodies] == [texts, ["who is alpha"], ["beta only", "alpha only"], ["beta?"]]
    assert all(b["path"] == "/v1/embeddings" and b["model"] == "emb" for b in bodies)
    assert len(peers) == 1  # one connection for both documents' indexes and queries


# -- what the policy is told, and switching activation at evaluation and inference -------------------

# The tool schema of `activation: all`, as the kept warm start and every broadcast policy were trained on it.
BROADCAST_SCHEMA = {
    "type": "function",
    "function": {
        "name": "query_agents",
        "description": "Send questions to every chunk reader of the document and collect what they find.",
        "parameters": {
            "type": "object",
            "properties": {
                "queries": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "One or more focused, self-contained questions. Independent questions go in one call.",
                }
            },
            "required": ["queries"],
        },
        "return": {
            "type": "string",
            "description": "The readers' findings, each tagged with its chunk; readers that found nothing are left out.",
        },
    },
}


def _schemas(env) -> list[dict]:
    from transformers.utils import get_json_schema

    return [get_json_schema(tool) for tool in env_tools(env)]


def test_default_tool_schema_is_the_one_broadcast_policies_were_trained_on(tok):
    from coordrl.inference.export import tool_schemas

    env = ParserEnvFactory(tokenizer=tok)()
    assert type(env) is ParserLeadEnv
    assert _schemas(env) == tool_schemas("parser") == tool_schemas("parser", ParserEnvConfig().to_dict())
    # Byte for byte, as the chat template renders it.
    assert json.dumps(_schemas(env)) == json.dumps([BROADCAST_SCHEMA])


def test_routed_tool_description_says_only_matching_chunks_are_read(samples, tok):
    from coordrl.inference.export import tool_schemas

    factory, reader = make(tok, **ROUTED)
    env = factory()
    assert isinstance(env, RoutedParserLeadEnv)
    (schema,) = _schemas(env)
    description = schema["function"]["description"]
    assert (
        "every chunk reader" not in description and "only to the readers of the chunks that best match" in description
    )
    assert "decide which chunks are read" in schema["function"]["parameters"]["properties"]["queries"]["description"]
    # Same name, arguments and result as broadcast: only the words differ.
    assert schema["function"]["name"] == "query_agents"
    assert schema["function"]["parameters"]["required"] == ["queries"] and "return" in schema["function"]
    # What evaluation and inference render (StepEnv) and what an export records are the routed description too.
    assert StepEnv(env, ChatCodec(tok), max_turns=2).tools[0].__doc__ == RoutedParserLeadEnv.query_agents.__doc__
    assert tool_schemas("parser", ParserEnvConfig(**ROUTED).to_dict()) == [schema]
    # The routed tool runs the same episode code.
    env.reset(**samples[0])
    ask(env, QUERIES)
    assert 0 < len(reader.asked) < 2 * len(env.chunks)


def test_export_records_the_tool_schema_of_the_trained_activation(tmp_path):
    from coordrl.inference.export import _policy_meta

    for env, described in (
        (ParserEnvConfig().to_dict(), "every chunk reader"),
        (ParserEnvConfig(**ROUTED).to_dict(), "best match"),
    ):
        meta = _policy_meta(tmp_path, {"protocol": "parser", "env": env}, "model")
        assert described in meta["tools"][0]["function"]["description"]


def test_eval_and_answer_switch_a_policy_to_routed_activation(built, samples, tmp_path, capsys):
    from coordrl.cli import main
    from coordrl.envs.protocols import get_protocol

    row = samples[0]
    doc = tmp_path / "doc.txt"
    doc.write_text(row["context"], encoding="utf-8")
    infos = {}
    for activation in (None, "routed"):
        flags = ["--activation", activation] if activation else []
        args = ["answer", "--policy", "scripted", "--document", str(doc), "--question", row["question"]]
        assert main([*args, "--chunk-tokens", "512", "--json", *flags]) in (0, 1)
        infos[activation] = json.loads(capsys.readouterr().out)["info"]
    chunks = infos[None]["chunks"]
    assert chunks > 16 and infos[None]["activated_chunks_per_query"] == chunks  # the recorded default: broadcast
    assert 0 < infos["routed"]["activated_chunks_per_query"] <= 16  # bm25 top-8 + summary top-8

    out = tmp_path / "eval"
    flags = ["--limit", "1", "--chunk-tokens", "512", "--no-progress", "--activation", "routed"]
    assert main(["eval", "--policy", "scripted", "--data", str(built), "--out", str(out), *flags]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["env"]["activation"] == "routed" and results["settings"]["activation"] == "routed"
    assert results["overall"]["activated_chunks_per_query"] <= 16
    assert "routed activation (bm25 top-8, summary top-8)" in (out / "results.md").read_text()
    # A rerun into the same folder with another activation is refused instead of mixing the two.
    assert main(["eval", "--policy", "scripted", "--data", str(built), "--out", str(out), *flags[:-1], "all"]) == 2
    assert "activation" in capsys.readouterr().err
    with pytest.raises(ValueError, match="activation"):
        get_protocol("hmars").eval_settings(None, None, None, None, None, "routed")
