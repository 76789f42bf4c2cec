"""The PARSER lead-agent environment: scatter queries to frozen chunk readers, gather findings.

One instance per rollout, in the shape TRL's ``environment_factory`` expects: ``reset(**row)`` binds
a sample and the public async method ``query_agents`` is the only tool (TRL exposes every public
method of the class as a tool, so everything else here is private or a property). The plain
``step`` API for code outside TRL lives in `coordrl.envs.step` and drives this same class.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from coordrl.data.chunk import Chunk, chunk_context
from coordrl.data.errors import ConfigError
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.tool_input import ToolInputError, check_text
from coordrl.readers.base import ReaderFleet, ReaderRequest, ReaderResult, chunk_key
from coordrl.readers.chat_client import DEFAULT_CONCURRENCY
from coordrl.readers.fleet import make_fleet
from coordrl.readers.loop import shared_loop
from coordrl.readers.prompt import READER_INSTRUCTIONS, sanitize_reader_text
from coordrl.readers.retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S
from coordrl.readers.routing import ACTIVATIONS, RouterCache, RouterSettings, document_key
from coordrl.rewards.metrics import nearest_rank_percentile

TRUNCATION_MARKER = (
    "[observation truncated: {n} more findings not shown (budget {budget} tokens); ask narrower questions]"
)


@dataclass
class ParserEnvConfig:
    """Settings of the PARSER environment (recorded in checkpoints and exports).

    Attributes:
        readers: ``lexical`` or comma-separated OpenAI-compatible server URLs.
        reader_model: model name served at the URLs.
        lexical_threshold: weighted query coverage a lexical reader needs to answer (default 0.5).
        reader_max_tokens: tokens a reader may generate per answer (PARSER: 512).
        reader_concurrency: reader requests in flight per process (default 64).
        reader_timeout_s / reader_retries: per attempt timeout and retries before a reader counts as unavailable.
        chunk_tokens: tokens per reader chunk (512 for training, 4,096 for evaluation).
        chunk_overlap_tokens: tokens each reader chunk shares with the next (default 0: chunks tile the
            document); chunks then start every ``chunk_tokens - chunk_overlap_tokens`` tokens, so a
            fact of up to this many tokens on a chunk boundary is read whole by one reader.
            ``0 <= chunk_overlap_tokens < chunk_tokens``.
        tokenizer: tokenizer for chunking and the observation budget (None: coordrl's shipped tokenizer;
            use the policy's).
        max_queries: queries accepted in one call (default 8).
        max_query_chars: characters accepted per query (default 500).
        observation_max_tokens: tokens of one observation before it is truncated with a visible marker.
        max_turns: tool rounds per episode (9 for training, 12 for evaluation).
        activation: which chunk readers a query wakes: ``all`` (default, PARSER's broadcast) or
            ``routed`` (only the union of the routing pathways' top-k chunks; `coordrl.readers.routing`).
        route_bm25_top_k: chunks BM25 over the chunk texts proposes per query (default 8; 0: pathway off).
        route_summary_top_k: chunks BM25 over per-chunk lexical summaries proposes per query (default 8; 0: off).
        route_dense_top_k: chunks embedding similarity proposes per query (default 0: off; needs
            ``route_dense_url`` and ``route_dense_model``).
        route_dense_url / route_dense_model: an OpenAI-compatible ``/v1/embeddings`` server and its
            model (default None).
        reader_cost_weight: weight of one reader prompt token against one lead token in the episode's
            normalised cost (default 0.1, the 1:10 ratio E-mem reports for small versus large models).
    """

    readers: str = "lexical"
    reader_model: str | None = None
    lexical_threshold: float = 0.5
    reader_max_tokens: int = 512
    reader_concurrency: int = DEFAULT_CONCURRENCY
    reader_timeout_s: float = DEFAULT_TIMEOUT_S
    reader_retries: int = DEFAULT_RETRIES
    chunk_tokens: int = 512
    chunk_overlap_tokens: int = 0
    tokenizer: str | None = None
    max_queries: int = 8
    max_query_chars: int = 500
    observation_max_tokens: int = 1024
    max_turns: int = 9
    activation: str = "all"
    route_bm25_top_k: int = RouterSettings.bm25_top_k
    route_summary_top_k: int = RouterSettings.summary_top_k
    route_dense_top_k: int = RouterSettings.dense_top_k
    route_dense_url: str | None = RouterSettings.dense_url
    route_dense_model: str | None = RouterSettings.dense_model
    reader_cost_weight: float = 0.1

    def __post_init__(self) -> None:
        overlap = self.chunk_overlap_tokens
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < self.chunk_tokens:
            raise ConfigError(
                f"chunk_overlap_tokens: must be a whole number >= 0 and below chunk_tokens ({self.chunk_tokens}), "
                f"got {overlap!r}"
            )
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation: must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        ks = ("route_bm25_top_k", "route_summary_top_k", "route_dense_top_k")
        for name in ks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}: must be a whole number >= 0 (0 switches the pathway off), got {value!r}")
        if isinstance(self.reader_cost_weight, bool) or not isinstance(self.reader_cost_weight, (int, float)):
            raise ConfigError(f"reader_cost_weight: must be a number >= 0, got {self.reader_cost_weight!r}")
        if self.reader_cost_weight < 0:
            raise ConfigError(f"reader_cost_weight: must be >= 0, got {self.reader_cost_weight}")
        if self.activation != "routed":
            return
        if not any(getattr(self, name) for name in ks):
            raise ConfigError(f"activation: routed needs at least one pathway on ({', '.join(ks)} > 0)")
        if self.route_dense_top_k:
            url = self.route_dense_url
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"route_dense_url: route_dense_top_k > 0 needs an http(s) server with /v1/embeddings, got {url!r}"
                )
            if not self.route_dense_model:
                raise ConfigError("route_dense_model: route_dense_top_k > 0 needs the embedding model's name")

    def router_settings(self) -> RouterSettings:
        """The routing pathways of ``activation: routed``: each ``route_*`` setting is the `RouterSettings`
        field of that name without the prefix; dense requests take the readers' timeout."""
        pathways = {
            f.name.removeprefix("route_"): getattr(self, f.name) for f in fields(self) if f.name.startswith("route_")
        }
        return RouterSettings(**pathways, dense_timeout_s=self.reader_timeout_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EpisodeStats:
    """Counters of one episode; `ParserLeadEnv.info` reports them."""

    queries_per_turn: list[int] = field(default_factory=list)
    reader_calls: int = 0
    abstentions: int = 0
    reader_errors: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    observation_tokens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    gold_found: bool = False
    findings: list[dict[str, Any]] = field(default_factory=list)
    activated_per_query: list[int] = field(default_factory=list)
    activated: set[int] = field(default_factory=set)
    reader_prompt_tokens: int = 0
    router_seconds: float = 0.0
    router_errors: int = 0


class ParserLeadEnv:
    """One PARSER rollout. Build through `ParserEnvFactory` so instances share a reader fleet.

    ``reset(**row)`` takes a dataset row with ``question``, ``answers`` (or ``answer``),
    ``gold_documents`` and either ``context`` (+ ``doc_offsets``), chunked here with
    ``chunk_tokens``, or precomputed ``chunks`` (list of strings) with optional ``chunk_documents``.
    """

    def __init__(
        self,
        config: ParserEnvConfig,
        fleet: ReaderFleet,
        tokenizer,
        chunk_cache: ChunkCache | None = None,
        router_cache: RouterCache | None = None,
    ) -> None:
        self._config = config
        self._fleet = fleet
        self._tokenizer = tokenizer
        self._chunk_cache = chunk_cache if chunk_cache is not None else ChunkCache(0)
        self._router_cache = router_cache if router_cache is not None else RouterCache(0)
        self._chunk_tokens: list[int | None] = []
        self._prompt_overhead: int | None = None
        self._row: dict[str, Any] = {}
        self._chunks: list[Chunk] = []
        self._keys: list[str] = []
        self._stats = EpisodeStats()
        self._question = ""
        self._gold: set[int] = set()

    # -- TRL interface ---------------------------------------------------------------------------

    def reset(self, **row: Any) -> None:
        """Bind a sample. Raises ValueError naming the field when the row cannot be used."""
        rid = row.get("id", "?")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"sample {rid!r}: field 'question' is missing or empty")
        if row.get("chunks") is not None:
            texts = list(row["chunks"])
            docs = row.get("chunk_documents") or [[] for _ in texts]
            self._chunks = [Chunk(i, t, 0, 0, 0, 0, tuple(d)) for i, (t, d) in enumerate(zip(texts, docs, strict=True))]
        elif isinstance(row.get("context"), str) and row["context"]:
            size, overlap = self._config.chunk_tokens, self._config.chunk_overlap_tokens
            self._chunks = self._chunk_cache.get(
                row["context"], (size, overlap), row.get("doc_offsets"),
                lambda: chunk_context(row["context"], self._tokenizer, size, row.get("doc_offsets"), overlap),
            )  # fmt: skip
        else:
            raise ValueError(f"sample {rid!r}: needs a non-empty 'context' or 'chunks' field")
        # A content hash, not an index: the same chunk text routes to the same reader replica (prefix cache).
        self._keys = [chunk_key(c.text) for c in self._chunks]
        self._chunk_tokens = [
            c.token_end - c.token_start if c.token_end > c.token_start else None for c in self._chunks
        ]
        self._row = row
        self._question = question
        self._gold = set(row.get("gold_documents") or ())
        self._stats = EpisodeStats()

    async def query_agents(self, queries: list[str]) -> str:
        """Send questions to every chunk reader of the document and collect what they find.

        Args:
            queries: One or more focused, self-contained questions. Independent questions go in one call.

        Returns:
            The readers' findings, each tagged with its chunk; readers that found nothing are left out.
        """
        turn = len(self._stats.queries_per_turn) + 1
        try:
            clean = self._validate(queries)
        except Exception as exc:
            # Anything but a ToolInputError is an argument object that broke while being read.
            err = (
                exc
                if isinstance(exc, ToolInputError)
                else ToolInputError(
                    "unreadable", f"queries could not be read ({type(exc).__name__}); send a list of strings"
                )
            )
            self._stats.tool_errors[err.kind] += 1
            self._stats.queries_per_turn.append(0)
            return f"Error: {err}"
        self._stats.queries_per_turn.append(len(clean))
        plan = self._activate(clean)
        requests = [ReaderRequest(q, self._chunks[i].text, self._keys[i]) for q, idx in zip(clean, plan) for i in idx]
        t0 = time.perf_counter()
        results = await shared_loop().run_async(self._fleet.answer(requests)) if requests else []
        if len(results) != len(requests):  # a broken backend must not silently misalign findings
            raise RuntimeError(f"reader fleet returned {len(results)} results for {len(requests)} requests")
        self._stats.reader_calls += len(requests)
        self._count_reader_tokens(clean, plan)
        observation = self._observe(clean, plan, results, turn, time.perf_counter() - t0)
        return observation

    # -- reporting --------------------------------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        """Per-episode metrics (floats and ints only, so they log anywhere)."""
        s = self._stats
        turns = len(s.queries_per_turn)
        answered = s.reader_calls - s.reader_errors
        return {
            "turns": turns,
            "queries": sum(s.queries_per_turn),
            "queries_per_turn": sum(s.queries_per_turn) / turns if turns else 0.0,
            "reader_calls": s.reader_calls,
            "abstain_rate": s.abstentions / answered if answered else 0.0,
            "observation_tokens": sum(s.observation_tokens),
            "reader_latency_p50_s": nearest_rank_percentile(s.latencies, 50) if s.latencies else 0.0,
            "reader_latency_p95_s": nearest_rank_percentile(s.latencies, 95) if s.latencies else 0.0,
            "reader_errors": s.reader_errors,
            "tool_errors": sum(s.tool_errors.values()),
            "gold_coverage": float(s.gold_found),
            "chunks": len(self._chunks),
            "activated_chunks_per_query": (
                sum(s.activated_per_query) / len(s.activated_per_query) if s.activated_per_query else 0.0
            ),
            "gold_activation_recall": self._gold_activation_recall(),
            "router_ms_per_query": (
                1000 * s.router_seconds / len(s.activated_per_query) if s.activated_per_query else 0.0
            ),
            "router_errors": s.router_errors,
            "reader_prompt_tokens": s.reader_prompt_tokens,
            # Reader prompt tokens in lead-token units; `StepEnv` adds the lead's own tokens (normalised cost).
            "reader_cost": self._config.reader_cost_weight * s.reader_prompt_tokens,
        }

    @property
    def tool_error_kinds(self) -> dict[str, int]:
        return dict(self._stats.tool_errors)

    @property
    def findings(self) -> list[dict[str, Any]]:
        """Every non-abstaining reader answer so far, in turn, query and document order: turn, query, chunk,
        its token span (token_start, token_end), the Documents it covers, and the text."""
        return list(self._stats.findings)

    @property
    def sample(self) -> dict[str, Any]:
        return self._row

    @property
    def chunks(self) -> list[Chunk]:
        return list(self._chunks)

    # -- internals --------------------------------------------------------------------------------

    def _validate(self, queries: Any) -> list[str]:
        cfg = self._config
        if not self._chunks:
            raise ToolInputError("not_reset", "the environment has no document; reset() was not called")
        if isinstance(queries, str):
            raise ToolInputError(
                "wrong_type", 'queries must be a list of strings, e.g. {"queries": ["Who directed X?"]}, not one string'
            )
        if not isinstance(queries, (list, tuple)):
            raise ToolInputError("wrong_type", f"queries must be a list of strings, got {type(queries).__name__}")
        if not queries:
            raise ToolInputError("empty", "queries is empty; give at least one question")
        if len(queries) > cfg.max_queries:
            raise ToolInputError("too_many", f"{len(queries)} queries in one call; the limit is {cfg.max_queries}")
        clean: list[str] = []
        for i, q in enumerate(queries, start=1):
            q = " ".join(check_text(q, f"query {i}").split())
            if not q:
                raise ToolInputError("empty", f"query {i} is empty")
            if len(q) > cfg.max_query_chars:
                raise ToolInputError(
                    "too_long", f"query {i} has {len(q)} characters; the limit is {cfg.max_query_chars}"
                )
            if q not in clean:  # an exact repeat in one call would only duplicate every finding
                clean.append(q)
        return clean

    def _count(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _count_batch(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self._tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _activate(self, queries: list[str]) -> list[Sequence[int]]:
        """The chunks each query wakes: all of them, or the router's union of pathway proposals."""
        s = self._stats
        if self._config.activation == "all":
            plan: list[Sequence[int]] = [range(len(self._chunks))] * len(queries)
        else:
            t0 = time.perf_counter()
            settings = self._config.router_settings()
            router = self._router_cache.get(document_key(self._keys), [c.text for c in self._chunks], settings)
            routes = [router.route(q, settings) for q in queries]
            s.router_seconds += time.perf_counter() - t0
            s.router_errors += sum(len(r.errors) for r in routes)
            plan = [r.chunks for r in routes]
        for idx in plan:
            s.activated_per_query.append(len(idx))
            s.activated.update(idx)
        return plan

    def _gold_activation_recall(self) -> float:
        """Share of the chunks holding a gold Document that some query woke (0.0 without gold chunks)."""
        gold = {c.index for c in self._chunks if set(c.documents) & self._gold}
        return len(gold & self._stats.activated) / len(gold) if gold else 0.0

    def _count_reader_tokens(self, queries: list[str], plan: list[Sequence[int]]) -> None:
        """Reader prompt tokens of this call: instructions, chunk and query per request, counted with
        the environment's tokenizer (the policy's; a reader with another tokenizer counts a little differently)."""
        if self._prompt_overhead is None:
            self._prompt_overhead = self._count(READER_INSTRUCTIONS) + self._count("Passage:\n\n\nQuestion: ")
        missing = sorted({i for idx in plan for i in idx if self._chunk_tokens[i] is None})
        if missing:
            counts = self._chunk_cache.token_counts(
                [self._keys[i] for i in missing], [self._chunks[i].text for i in missing], self._count_batch
            )
            for i, n in zip(missing, counts, strict=True):
                self._chunk_tokens[i] = n
        for q, idx in zip(queries, plan):
            per_request = self._prompt_overhead + self._count(q)
            self._stats.reader_prompt_tokens += len(idx) * per_request + sum(self._chunk_tokens[i] for i in idx)

    def _observe(
        self, queries: list[str], plan: list[Sequence[int]], results: list[ReaderResult], turn: int, wall: float
    ) -> str:
        s = self._stats
        budget = self._config.observation_max_tokens
        lines: list[str] = []
        hidden = 0
        used = 0
        total_found = 0
        start = 0
        for qi, query in enumerate(queries):
            block = results[start : start + len(plan[qi])]
            start += len(plan[qi])
            found: list[str] = []
            down: list[int] = []
            for chunk, res in zip((self._chunks[i] for i in plan[qi]), block, strict=True):
                s.latencies.append(res.latency_s)
                if not res.ok:
                    s.reader_errors += 1
                    down.append(chunk.index)
                    continue
                if res.abstained:
                    s.abstentions += 1
                    continue
                text = " ".join(sanitize_reader_text(res.text).split())
                if not text:
                    s.abstentions += 1
                    continue
                if set(chunk.documents) & self._gold:
                    s.gold_found = True
                s.findings.append(
                    {
                        "turn": turn,
                        "query": query,
                        "chunk": chunk.index,
                        # Where in the document: overlapping chunks can report one fact twice.
                        "token_start": chunk.token_start,
                        "token_end": chunk.token_end,
                        "documents": list(chunk.documents),
                        "text": text,
                    }
                )
                found.append(f"- chunk {chunk.index}: {text}")
            total_found += len(found)
            header = f'Query {qi + 1}: "{query}"'
            if not plan[qi]:
                # Routed only: no pathway scored any chunk, so no reader was asked.
                found = ["- no chunk matched this query's words, so no reader was asked; name people, places or terms."]
            block_lines = [header] + (found or ["- no reader found anything for this query."])
            if down:
                block_lines.append(
                    f"- {len(down)} reader(s) unavailable (chunks {_ranges(down)}); their chunks were not read this round."
                )
            for line in block_lines:
                cost = self._count(line) + 1
                if line.startswith("- chunk") and (hidden or used + cost > budget):
                    hidden += 1
                    continue
                used += cost
                lines.append(line)
        n_readers = len(self._chunks) if self._config.activation == "all" else len(set().union(*plan))
        head = f"{total_found} finding(s) from {n_readers} readers for {len(queries)} query(ies)."
        if hidden:
            lines.append(TRUNCATION_MARKER.format(n=hidden, budget=budget))
        observation = "\n".join([head] + lines)
        s.observation_tokens.append(self._count(observation))
        return observation


class RoutedParserLeadEnv(ParserLeadEnv):
    """`ParserLeadEnv` under ``activation: routed``. TRL and `env_tools` read the tool's description
    from the method's docstring, so routing gets its own method saying what the tool then does;
    the default environment's description stays the one broadcast policies were trained on."""

    async def query_agents(self, queries: list[str]) -> str:
        """Send each question only to the readers of the chunks that best match it and collect what they find.

        Args:
            queries: One or more focused, self-contained questions. Independent questions go in one call. Name the people, places or terms you ask about: they decide which chunks are read.

        Returns:
            The readers' findings, each tagged with its chunk; readers that found nothing are left out.
        """
        return await super().query_agents(queries)


def lead_env_class(config: ParserEnvConfig) -> type[ParserLeadEnv]:
    """The environment class of ``config``'s activation (the classes differ only in the tool's description)."""
    return RoutedParserLeadEnv if config.activation == "routed" else ParserLeadEnv


def _ranges(indices: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``: a short list of chunk numbers."""
    out: list[str] = []
    start = prev = None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ", ".join(out)


class ChunkCache:
    """Chunks of recent contexts: GRPO resets several rollouts on the same sample, and chunking a
    long context (tokenizing it) is the costly part of ``reset``. Chunks are immutable, so sharing is safe."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, list[Chunk]] = OrderedDict()
        self._counts: OrderedDict[str, int] = OrderedDict()
        self.hits = 0

    def get(self, context: str, chunking: Hashable, doc_offsets: Sequence[int] | None, compute) -> list[Chunk]:
        """The chunks of ``context`` under ``chunking`` (the settings that shape them), computed once."""
        if self.max_entries <= 0:
            return compute()
        key = (hashlib.sha1(context.encode()).digest(), chunking, tuple(doc_offsets or ()))
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        chunks = compute()
        self._entries[key] = chunks
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return chunks

    def token_counts(self, keys: Sequence[str], texts: Sequence[str], count_batch) -> list[int]:
        """Token counts of chunk ``texts`` (``keys``: their content hashes), the uncached ones counted in
        one ``count_batch`` call. Precomputed chunks (the world's rows) carry no token span, and at 1,024
        documents counting 512 chunks one call at a time was two thirds of an episode's CPU time."""
        if self.max_entries <= 0:
            return count_batch(list(texts))
        todo = [j for j, k in enumerate(keys) if k not in self._counts]
        if todo:
            for j, n in zip(todo, count_batch([texts[j] for j in todo]), strict=True):
                self._counts[keys[j]] = n
            while len(self._counts) > self.max_entries * 64:  # about 64 chunks per cached context
                self._counts.popitem(last=False)
        return [self._counts[k] for k in keys]


class ParserEnvFactory:
    """``environment_factory`` for TRL: every call returns a fresh `ParserLeadEnv` sharing one
    reader fleet and tokenizer (created on first use)."""

    def __init__(self, config: ParserEnvConfig | None = None, fleet: ReaderFleet | None = None, tokenizer=None) -> None:
        self.config = config or ParserEnvConfig()
        self._fleet = fleet
        self._tokenizer = tokenizer
        self.chunk_cache = ChunkCache()
        self.router_cache = RouterCache()

    @property
    def fleet(self) -> ReaderFleet:
        if self._fleet is None:
            c = self.config
            self._fleet = make_fleet(
                c.readers,
                c.reader_model,
                max_concurrency=c.reader_concurrency,
                timeout_s=c.reader_timeout_s,
                max_retries=c.reader_retries,
                max_tokens=c.reader_max_tokens,
                threshold=c.lexical_threshold,
            )
        return self._fleet

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.tokenizer)
        return self._tokenizer

    def __call__(self) -> ParserLeadEnv:
        env_cls = lead_env_class(self.config)
        return env_cls(self.config, self.fleet, self.tokenizer, self.chunk_cache, self.router_cache)

    def close(self) -> None:
        self.router_cache.close()
        if self._fleet is not None:
            shared_loop().run(self._fleet.aclose())
