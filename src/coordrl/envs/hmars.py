"""The HMARS mid-agent environment: one broadcast, full fan-out page selection, one frozen answer.

One instance per rollout, in the shape TRL's ``environment_factory`` expects. ``reset(**row)``
loads (or builds and caches) the row's index (`coordrl.envs.hmars_index`), binds ONE mid-agent
region and returns that region's memory as text, which TRL appends to the last user message. The
only tool is ``broadcast(interpretation, hints)``: every sub-agent of the region then selects pages
in parallel with the selector backend, the selected pages are deduplicated and ordered by offset,
and the answer backend answers from them. ``get_reward()`` owns the reward (TRL calls it).

Region binding, by design: training samples are sized to one mid-agent (``c_sub * group_size``
tokens or fewer: at the training defaults below every ~28K-token sample is a single region), so
``reset`` binds group 0. A longer document still trains on group 0 only (``info["regions"]``
shows it; ``gold_in_region`` says whether the gold evidence was reachable). At inference,
`run_all_regions` runs all K mid-agents concurrently with the same policy and answers once from
the merged evidence.

Everything the class exposes besides ``reset``, ``broadcast`` and ``get_reward`` is private or a
property: TRL turns every public method into a tool.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from coordrl.data.errors import DataError
from coordrl.envs.hmars_index import (
    DocumentIndex,
    IndexCache,
    IndexSettings,
    Page,
    build_index,
    index_key,
    make_chat_endpoint,
    parse_json_object,
)
from coordrl.envs.hmars_prompts import answer_messages, hmars_prompt, selector_messages
from coordrl.envs.tool_input import (
    ToolInputError,
    check_text,
    safe_str,
    tool_call_too_deep,
)
from coordrl.readers.lexical import LexicalReader, content_words, split_chunk_sentences
from coordrl.readers.loop import shared_loop
from coordrl.readers.prompt import sanitize_reader_text
from coordrl.rewards.extract import extract_answer
from coordrl.rewards.metrics import exact_match, f1_score

__all__ = [
    "MODES",
    "HmarsEnvConfig",
    "HmarsEnvFactory",
    "MidAgentEnv",
    "MultiRegionResult",
    "answer_all_regions",
    "parse_broadcast",
    "run_all_regions",
]

MODES = ("full", "dispatch", "no_mid")
# Failures of the frozen model roles, counted per role: the endpoint failed after its retries
# (HTTP error, timeout, empty or non-JSON body), or its reply could not be parsed.
ROLE_ERROR_KEYS = ("selector_errors", "selector_parse_failures", "answerer_errors", "answerer_parse_failures")
_SUB_ID = re.compile(r"^\s*(?:s|sub[-_ ]?agent[-_ ]?)?(\d{1,6})\s*$", re.IGNORECASE)


@dataclass
class HmarsEnvConfig:
    """Settings of the HMARS mid-agent environment (recorded in checkpoints and exports).

    Attributes:
        c_sub: tokens per sub-agent region (paper: 16,384; default 16,384).
        page_tokens: tokens per page (default 1,024).
        group_size: sub-agents per mid-agent, G (default 10).
        writer / selector / answerer: ``lexical`` (model-free, deterministic) or comma-separated
            OpenAI-compatible URLs, one backend per role.
        writer_model / selector_model / answerer_model: model names served at those URLs.
        writer_api_key_env / selector_api_key_env / answerer_api_key_env: environment variables read
            for each role's API key (default OPENAI_API_KEY; unset sends none).
        writer_max_tokens / selector_max_tokens / answerer_max_tokens: generation budgets
            (defaults 512, 256, 128).
        writer_input_chars: region characters shown to a card writer (default 48,000).
        selector_page_chars: characters of each page shown to a model selector (default 6,000: a
            whole 1,024-token page).
        backend_concurrency / backend_timeout_s / backend_retries: per-role request limits
            (defaults 64, 60 s, 3 retries).
        max_interpretation_chars: longest accepted interpretation (default 1,000).
        max_hint_chars: longest accepted hint (default 500).
        pages_per_subagent: pages one sub-agent may select (default 2).
        lexical_select_threshold: lexical page score needed to be selected (default 0.4).
        mode: ``full`` (every sub-agent selects, default), ``dispatch`` (only hinted sub-agents
            select) or ``no_mid`` (every sub-agent selects from the question alone).
        recall_weight: weight of supporting-page recall in the reward (default 0).
        evidence_budget_tokens / budget_weight: evidence tokens above the budget cost
            ``budget_weight * excess / budget`` (default 0: off).
        tokenizer: tokenizer for pages and token counts (None: coordrl's shipped one; use the policy's).
        index_cache: folder of cached indexes (``coordrl index`` writes it); None: memory only.
    """

    c_sub: int = 16384
    page_tokens: int = 1024
    group_size: int = 10
    writer: str = "lexical"
    writer_model: str | None = None
    writer_api_key_env: str | None = "OPENAI_API_KEY"
    writer_max_tokens: int = 512
    writer_input_chars: int = 48000
    selector: str = "lexical"
    selector_model: str | None = None
    selector_api_key_env: str | None = "OPENAI_API_KEY"
    selector_max_tokens: int = 256
    selector_page_chars: int = 6000
    answerer: str = "lexical"
    answerer_model: str | None = None
    answerer_api_key_env: str | None = "OPENAI_API_KEY"
    answerer_max_tokens: int = 128
    backend_concurrency: int = 64
    backend_timeout_s: float = 60.0
    backend_retries: int = 3
    max_interpretation_chars: int = 1000
    max_hint_chars: int = 500
    pages_per_subagent: int = 2
    lexical_select_threshold: float = 0.4
    mode: str = "full"
    recall_weight: float = 0.0
    evidence_budget_tokens: int = 0
    budget_weight: float = 0.0
    tokenizer: str | None = None
    index_cache: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DataError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.pages_per_subagent < 1:
            raise DataError(f"pages_per_subagent must be positive, got {self.pages_per_subagent}")

    def index_settings(self) -> IndexSettings:
        return IndexSettings(
            c_sub=self.c_sub,
            page_tokens=self.page_tokens,
            group_size=self.group_size,
            tokenizer=self.tokenizer,
            writer=self.writer,
            writer_model=self.writer_model,
            writer_api_key_env=self.writer_api_key_env,
            writer_max_tokens=self.writer_max_tokens,
            writer_input_chars=self.writer_input_chars,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- backends ---------------------------------------------------------------------------------------


@dataclass
class _Selection:
    """One sub-agent's selection: page ids with confidences, or an error."""

    subagent: int
    pages: list[int] = field(default_factory=list)
    confidence: dict[int, float] = field(default_factory=dict)
    ok: bool = True
    error: str | None = None
    parse_failed: bool = False
    model_call: bool = False


@dataclass
class _Answer:
    text: str
    ok: bool = True
    error: str | None = None
    model_call: bool = False
    parse_failed: bool = False


class _Backends:
    """The frozen roles shared by every environment of a factory: one endpoint (one connection
    pool) per model role, and one lexical scorer whose page indexes are reused across rollouts."""

    def __init__(self, config: HmarsEnvConfig) -> None:
        c = config
        common = {
            "max_concurrency": c.backend_concurrency,
            "timeout_s": c.backend_timeout_s,
            "max_retries": c.backend_retries,
        }
        self.config = config
        self.writer = make_chat_endpoint(
            c.writer, c.writer_model, c.writer_api_key_env, max_tokens=c.writer_max_tokens, **common
        )
        self.selector = make_chat_endpoint(
            c.selector, c.selector_model, c.selector_api_key_env, max_tokens=c.selector_max_tokens, **common
        )
        self.answerer = make_chat_endpoint(
            c.answerer, c.answerer_model, c.answerer_api_key_env, max_tokens=c.answerer_max_tokens, **common
        )
        self.lexical = LexicalReader(threshold=0.0)

    # -- selection ---------------------------------------------------------------------------------

    def _lexical_select(self, pages: Sequence[Page], parts: Sequence[str]) -> _Selection:
        """Score each page by the best LexicalReader coverage over the query parts (question,
        interpretation, hint: each alone, so a precise hint is not diluted by a long question),
        keep the top ``pages_per_subagent`` at or above the threshold."""
        c = self.config
        scored = []
        for page in pages:
            key = f"hmars-page:{page.index}:{page.char_start}:{len(page.text)}"
            best = max((self.lexical.score(q, page.text, key)[0] for q in parts if q.strip()), default=0.0)
            scored.append((best, page.index))
        kept = sorted(
            (s for s in scored if s[0] >= c.lexical_select_threshold and s[0] > 0), key=lambda s: (-s[0], s[1])
        )[: c.pages_per_subagent]
        return _Selection(pages[0].subagent if pages else -1, [p for _, p in kept], {p: round(s, 4) for s, p in kept})

    def _parse_selection(self, text: str, allowed: set[int]) -> tuple[list[int], dict[int, float]] | None:
        reply = parse_json_object(text)
        if reply is None or not isinstance(reply.get("pages"), list):
            return None
        chosen: dict[int, float] = {}
        for item in reply["pages"]:
            raw, conf = (
                (item.get("id", item.get("page")), item.get("confidence", 1.0))
                if isinstance(item, dict)
                else (item, 1.0)
            )
            pid = _page_id(raw)
            if pid in allowed and pid not in chosen:  # ids outside this sub-agent's pages are dropped
                chosen[pid] = _confidence(conf)
        ranked = sorted(chosen, key=lambda p: (-chosen[p], p))[: self.config.pages_per_subagent]
        return ranked, {p: chosen[p] for p in ranked}

    async def select(
        self, question: str, jobs: Sequence[tuple[int, Sequence[Page], str, str | None, str | None]]
    ) -> list[_Selection]:
        """Every job ``(subagent, pages, card_text, interpretation, hint)`` concurrently."""
        c = self.config
        if self.selector is None:
            return [
                self._lexical_select(pages, [question, interp or "", hint or ""]) for _, pages, _, interp, hint in jobs
            ]
        convs = [
            selector_messages(question, card, interp, hint, [(p.index, p.text) for p in pages], c.selector_page_chars)
            for _, pages, card, interp, hint in jobs
        ]
        results = await self.selector.chat(convs, [f"sub:{j[0]}:{j[1][0].char_start if j[1] else 0}" for j in jobs])
        out = []
        for (sub, pages, _, interp, hint), res in zip(jobs, results, strict=True):
            if not res.ok:
                out.append(_Selection(sub, ok=False, error=res.error, model_call=True))
                continue
            parsed = self._parse_selection(res.text, {p.index for p in pages})
            if parsed is None:  # an unparseable reply still gets the sub-agent's pages considered
                sel = self._lexical_select(pages, [question, interp or "", hint or ""])
                sel.subagent, sel.parse_failed, sel.model_call = sub, True, True
                out.append(sel)
            else:
                out.append(_Selection(sub, parsed[0], parsed[1], model_call=True))
        return out

    # -- answering ---------------------------------------------------------------------------------

    @staticmethod
    def _lexical_answer(question: str, pages: Sequence[Page]) -> str:
        """Extractive: the evidence sentence (with its title) covering most of the question's words."""
        q = content_words(question)
        best, best_score = "", 0
        for page in pages:
            for title, sentence in split_chunk_sentences(page.text):
                score = len(q & (content_words(title) | content_words(sentence)))
                if score > best_score:  # strict: the earliest sentence wins ties
                    best, best_score = sentence, score
        return sanitize_reader_text(best)

    async def answer(self, question: str, pages: Sequence[Page], messages: list[dict[str, str]]) -> _Answer:
        if self.answerer is None:
            return _Answer(self._lexical_answer(question, pages))
        res = (await self.answerer.chat([messages], ["answer"]))[0]
        if not res.ok:
            return _Answer("", ok=False, error=res.error, model_call=True)
        tagged = extract_answer(res.text)
        # A reply without the tag still answers; it is counted so a bad answer prompt shows up.
        return _Answer(
            tagged if tagged is not None else " ".join(res.text.split())[:300],
            model_call=True,
            parse_failed=tagged is None,
        )

    async def aclose(self) -> None:
        for endpoint in (self.writer, self.selector, self.answerer):
            if endpoint is not None:
                await endpoint.aclose()


# -- environment ------------------------------------------------------------------------------------


@dataclass
class _Episode:
    broadcasts: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    backend_errors: int = 0
    parse_failures: int = 0
    # Per role, so a broken selector or answer endpoint shows up by name in episode info and tables.
    selector_errors: int = 0
    selector_parse_failures: int = 0
    answerer_errors: int = 0
    answerer_parse_failures: int = 0
    selector_calls: int = 0
    answer_calls: int = 0
    endpoint_calls: int = 0
    participants: list[int] = field(default_factory=list)
    hinted: list[int] = field(default_factory=list)
    selections: dict[int, _Selection] = field(default_factory=dict)
    pages: list[int] = field(default_factory=list)
    evidence_tokens: int = 0
    answer_prompt_tokens: int = 0
    answer: str | None = None
    selector_inputs: list[dict[str, Any]] = field(default_factory=list)


class MidAgentEnv:
    """One HMARS mid-agent rollout. Build through `HmarsEnvFactory` so instances share backends,
    tokenizer and index cache.

    ``reset(**row)`` takes a dataset row with ``question``, ``answers`` (or ``answer``),
    ``gold_documents``, ``context`` and ``doc_offsets``.
    """

    def __init__(self, config: HmarsEnvConfig, backends: _Backends, tokenizer, index_cache: IndexCache) -> None:
        self._config = config
        self._backends = backends
        self._tokenizer = tokenizer
        self._cache = index_cache
        self._row: dict[str, Any] = {}
        self._index: DocumentIndex | None = None
        self._group = 0
        self._question = ""
        self._golds: list[str] = []
        self._gold_docs: set[int] = set()
        self._ep = _Episode()

    # -- TRL interface -------------------------------------------------------------------------------

    def reset(self, **row: Any) -> str:
        """Bind a sample and its region 0; returns the regional memory (TRL appends it to the prompt).

        Raises ValueError naming the field when the row cannot be used.
        """
        rid = row.get("id", "?")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"sample {rid!r}: field 'question' is missing or empty")
        context = row.get("context")
        if not isinstance(context, str) or not context:
            raise ValueError(f"sample {rid!r}: field 'context' is missing or empty")
        self._index = self._load_index(context, row.get("doc_offsets"))
        if self._index.num_subagents == 0:
            raise ValueError(f"sample {rid!r}: the context produced no pages")
        answers = row.get("answers") if row.get("answers") is not None else row.get("answer")
        self._golds = [answers] if isinstance(answers, str) else [str(a) for a in (answers or [])]
        self._row = row
        self._question = question
        self._gold_docs = {int(d) for d in (row.get("gold_documents") or [])}
        return "\n\n" + self._bind_region(0)

    async def broadcast(self, interpretation: str, hints: dict[str, str]) -> str:
        """Broadcast your reading of the question and per-sub-agent hints; every sub-agent then selects evidence pages and the answer model answers from them. Call it once.

        Args:
            interpretation: What the question asks in this region: the entities, relations and facts needed, including bridge facts.
            hints: Maps sub-agent ids (e.g. "s0") to what that sub-agent should look for in its pages. Sub-agents without a hint get the interpretation.

        Returns:
            The pages each sub-agent selected and the answer model's answer.
        """
        try:
            interp, by_sub = self._checked(interpretation, hints)
        except ToolInputError as err:
            self._ep.tool_errors[err.kind] = self._ep.tool_errors.get(err.kind, 0) + 1
            return f"Error: {err}"
        selections = await self._select(interp, by_sub)
        pages = self._merge(selections)
        answer = await self._answer(pages)
        self._ep.broadcasts += 1
        return self._observe(selections, pages, answer)

    def get_reward(self) -> float:
        """Exact match of the answer model's answer (+ recall and budget terms when weighted)."""
        return float(self._terms()["reward"])

    # -- reporting -----------------------------------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        """Per-episode metrics (floats and ints only): reward terms, evidence, calls, errors."""
        ep, idx = self._ep, self._index
        region = self._region_subagents
        return {
            **self._terms(),
            "broadcasts": ep.broadcasts,
            "subagents": len(region),
            "regions": idx.num_regions if idx else 0,
            "region": self._group,
            "participants": len(ep.participants),
            "hinted": len(ep.hinted),
            "pages_selected": len(ep.pages),
            "evidence_tokens": ep.evidence_tokens,
            "answer_prompt_tokens": ep.answer_prompt_tokens,
            "selector_calls": ep.selector_calls,
            "answer_calls": ep.answer_calls,
            "model_calls": ep.selector_calls + ep.answer_calls,
            "endpoint_calls": ep.endpoint_calls,
            "tool_errors": sum(ep.tool_errors.values()),
            "backend_errors": ep.backend_errors,
            "parse_failures": ep.parse_failures,
            **{k: getattr(ep, k) for k in ROLE_ERROR_KEYS},
            "gold_in_region": self._gold_in_region(),
        }

    @property
    def tool_error_kinds(self) -> dict[str, int]:
        return dict(self._ep.tool_errors)

    @property
    def selections(self) -> dict[str, list[int]]:
        """Selected page ids per participating sub-agent id."""
        return {f"s{s}": list(sel.pages) for s, sel in self._ep.selections.items()}

    @property
    def selector_inputs(self) -> list[dict[str, Any]]:
        """What each selector was given this episode: subagent, interpretation, hint (None when withheld)."""
        return list(self._ep.selector_inputs)

    @property
    def answer(self) -> str | None:
        return self._ep.answer

    @property
    def index(self) -> DocumentIndex | None:
        return self._index

    @property
    def sample(self) -> dict[str, Any]:
        return self._row

    # -- internals -----------------------------------------------------------------------------------

    def _load_index(self, context: str, doc_offsets: Sequence[int] | None) -> DocumentIndex:
        settings = self._config.index_settings()
        key = index_key(context, doc_offsets, settings)
        found = self._cache.get(key, context)
        if found is None:
            # Model writers talk over the shared loop's connection pool; reset itself is synchronous.
            found = shared_loop().run(
                build_index(context, doc_offsets, self._tokenizer, settings, self._backends.writer, key)
            )
            self._cache.put(found)
        return found

    def _bind_region(self, group: int) -> str:
        """Bind mid-agent region ``group`` (inference runs every group; training uses 0) and start a
        fresh episode on it. Returns the regional memory text."""
        if self._index is None:
            raise RuntimeError("reset() first")
        if not 0 <= group < self._index.num_regions:
            raise ValueError(f"region {group} out of range: the document has {self._index.num_regions}")
        self._group = group
        self._ep = _Episode()
        # Titles, entities and model-written summaries in the memory are document text: data, never
        # markers (a title cannot close the prompt's user turn or carry an answer tag).
        return sanitize_reader_text(self._index.region_text(group))

    @property
    def _region_subagents(self) -> list[int]:
        return list(self._index.regions[self._group].subagents) if self._index else []

    def _gold_in_region(self) -> float:
        if not self._gold_docs or self._index is None:
            return 0.0
        docs = {
            d
            for s in self._region_subagents
            for p in self._index.subagent_pages[s]
            for d in self._index.pages[p].documents
        }
        return len(self._gold_docs & docs) / len(self._gold_docs)

    def _checked(self, interpretation: Any, hints: Any) -> tuple[str, dict[int, str]]:
        """`_validate`, with any other exception (an argument object that breaks while being read)
        turned into a `ToolInputError`: bad input is the policy's mistake, never a crash."""
        try:
            return self._validate(interpretation, hints)
        except ToolInputError:
            raise
        except Exception as exc:
            raise ToolInputError(
                "unreadable",
                f"the arguments could not be read ({type(exc).__name__}); send a string and an object of strings",
            ) from None

    def _validate(self, interpretation: Any, hints: Any) -> tuple[str, dict[int, str]]:
        c = self._config
        if self._index is None:
            raise ToolInputError("not_reset", "the environment has no document; reset() was not called")
        if self._ep.broadcasts:
            raise ToolInputError(
                "second_broadcast", "broadcast was already called in this episode and runs once; answer from its result"
            )
        if not isinstance(interpretation, str):
            raise ToolInputError("wrong_type", f"interpretation must be a string, got {type(interpretation).__name__}")
        interp = " ".join(check_text(interpretation, "interpretation").split())
        if not interp:
            raise ToolInputError("empty", "interpretation is empty; say what the question needs from this region")
        if len(interp) > c.max_interpretation_chars:
            raise ToolInputError(
                "too_long", f"interpretation has {len(interp)} characters; the limit is {c.max_interpretation_chars}"
            )
        if hints is None:
            hints = {}
        if not isinstance(hints, dict):
            raise ToolInputError(
                "wrong_type",
                f'hints must be an object mapping sub-agent ids to strings, e.g. {{"s0": "find X"}}, got {type(hints).__name__}',
            )
        region = set(self._region_subagents)
        valid = ", ".join(f"s{i}" for i in sorted(region))
        by_sub: dict[int, str] = {}
        for raw_key, value in hints.items():
            # Ids are strings in JSON; direct callers may pass small ints. Nothing else is printed:
            # str() of a huge int raises, and of an arbitrary object may.
            key = (
                str(raw_key)
                if isinstance(raw_key, int) and not isinstance(raw_key, bool) and abs(raw_key) < 10**6
                else raw_key
            )
            key = check_text(key, "a sub-agent id") if isinstance(key, str) else None
            match = _SUB_ID.match(key) if key is not None else None
            if match is None or int(match.group(1)) not in region:
                shown = repr(key[:40]) if key is not None else f"of type {type(raw_key).__name__}"
                raise ToolInputError(
                    "unknown_subagent", f"unknown sub-agent id {shown}; this region's sub-agents are {valid}"
                )
            sub = int(match.group(1))
            if not isinstance(value, str):
                raise ToolInputError("wrong_type", f"the hint for s{sub} must be a string, got {type(value).__name__}")
            if sub in by_sub:
                raise ToolInputError("duplicate", f"two hints for s{sub}")
            hint = " ".join(check_text(value, f"the hint for s{sub}").split())
            if len(hint) > c.max_hint_chars:
                raise ToolInputError(
                    "too_long", f"the hint for s{sub} has {len(hint)} characters; the limit is {c.max_hint_chars}"
                )
            if hint:  # an empty hint is a missing hint: the interpretation stands in for it
                by_sub[sub] = hint
        return interp, by_sub

    def _jobs(self, interp: str, by_sub: dict[int, str]) -> list[tuple[int, list[Page], str, str | None, str | None]]:
        """Who selects, with what, per the mode: full (all; hint or interpretation), dispatch (hinted
        only), no_mid (all; the question alone)."""
        assert self._index is not None
        mode = self._config.mode
        jobs = []
        for sub in self._region_subagents:
            if mode == "dispatch" and sub not in by_sub:
                continue
            interp_in, hint_in = (None, None) if mode == "no_mid" else (interp, by_sub.get(sub, interp))
            pages = [self._index.pages[p] for p in self._index.subagent_pages[sub]]
            jobs.append((sub, pages, self._index.cards[sub].text(), interp_in, hint_in))
        return jobs

    async def _select(self, interp: str, by_sub: dict[int, str]) -> list[_Selection]:
        ep = self._ep
        jobs = self._jobs(interp, by_sub)
        ep.hinted = sorted(by_sub)
        ep.participants = [j[0] for j in jobs]
        ep.selector_inputs = [{"subagent": j[0], "interpretation": j[3], "hint": j[4]} for j in jobs]
        selections = await shared_loop().run_async(self._backends.select(self._question, jobs)) if jobs else []
        for sel in selections:
            ep.selector_calls += 1
            ep.endpoint_calls += int(sel.model_call)
            ep.selector_errors += int(not sel.ok)
            ep.selector_parse_failures += int(sel.parse_failed)
            ep.backend_errors += int(not sel.ok)
            ep.parse_failures += int(sel.parse_failed)
            ep.selections[sel.subagent] = sel
        return selections

    def _merge(self, selections: Sequence[_Selection]) -> list[Page]:
        assert self._index is not None
        ids = sorted(
            {p for sel in selections if sel.ok for p in sel.pages}, key=lambda p: self._index.pages[p].token_start
        )
        return [self._index.pages[p] for p in ids]

    def _count(self, messages: Sequence[dict[str, str]]) -> int:
        return sum(len(self._tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages)

    async def _answer(self, pages: Sequence[Page]) -> _Answer:
        ep = self._ep
        messages = answer_messages(
            self._question, [(f"page {p.index} | Documents {_span(p.documents)}", p.text) for p in pages]
        )
        ep.pages = [p.index for p in pages]
        ep.evidence_tokens = sum(p.num_tokens for p in pages)
        ep.answer_prompt_tokens = self._count(messages)
        answer = await shared_loop().run_async(self._backends.answer(self._question, pages, messages))
        ep.answer_calls += 1
        ep.endpoint_calls += int(answer.model_call)
        ep.answerer_errors += int(not answer.ok)
        ep.answerer_parse_failures += int(answer.parse_failed)
        ep.backend_errors += int(not answer.ok)
        ep.parse_failures += int(answer.parse_failed)
        ep.answer = answer.text if answer.ok else None
        return answer

    def _observe(self, selections: Sequence[_Selection], pages: Sequence[Page], answer: _Answer | None) -> str:
        assert self._index is not None
        lines = [
            f"{len(selections)} of {len(self._region_subagents)} sub-agents selected pages (mode {self._config.mode})."
        ]
        for sel in selections:
            if not sel.ok:
                lines.append(
                    f"- s{sel.subagent}: unavailable (selector error: {sanitize_reader_text(safe_str(sel.error, 160))})"
                )
            elif not sel.pages:
                lines.append(f"- s{sel.subagent}: no page selected")
            else:
                picked = ", ".join(f"page {p} (Documents {_span(self._index.pages[p].documents)})" for p in sel.pages)
                lines.append(f"- s{sel.subagent}: {picked}")
        lines.append(f"Evidence: {len(pages)} page(s), {sum(p.num_tokens for p in pages)} tokens.")
        if answer is None:  # region-only broadcast (inference over K regions): one answer comes later
            lines.append("The evidence goes to the answer model together with the other regions' evidence.")
        elif answer.ok:
            lines.append(f"Answer: {' '.join(sanitize_reader_text(answer.text).split()) or '(empty)'}")
        else:
            lines.append(f"Answer model unavailable: {sanitize_reader_text(safe_str(answer.error, 160))}")
        return "\n".join(lines)

    def _recall(self, pages: Sequence[int]) -> float:
        if not self._gold_docs or self._index is None:
            return 0.0
        covered = {d for p in pages for d in self._index.pages[p].documents}
        return len(self._gold_docs & covered) / len(self._gold_docs)

    def _terms(self) -> dict[str, float]:
        c, ep = self._config, self._ep
        em = exact_match(ep.answer, self._golds) if ep.answer is not None and self._golds else 0.0
        f1 = f1_score(ep.answer, self._golds) if ep.answer is not None and self._golds else 0.0
        recall = self._recall(ep.pages)
        budget = 0.0
        if c.evidence_budget_tokens > 0 and c.budget_weight:
            budget = -c.budget_weight * max(0, ep.evidence_tokens - c.evidence_budget_tokens) / c.evidence_budget_tokens
        recall_term = c.recall_weight * recall
        return {
            "reward": em + recall_term + budget,
            "em": em,
            "f1": f1,
            "recall": recall,
            "recall_term": recall_term,
            "budget_term": budget,
        }


def _page_id(raw: Any) -> int | None:
    """A page id from a selector reply: an int, or a string like ``"3"`` / ``"p3"``; anything else
    (lists, objects, floats) is no id, and is never printed (``str`` of a huge int raises)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    match = _SUB_ID.match(raw.lstrip("pP")) if isinstance(raw, str) else None
    return int(match.group(1)) if match else None


def _confidence(conf: Any) -> float:
    """A selector's confidence as a finite float; 1.0 when it is missing, not a number, too large for
    a float, or not finite (NaN would make the ranking depend on reply order)."""
    if not isinstance(conf, (int, float)) or isinstance(conf, bool):
        return 1.0
    try:
        value = float(conf)
    except OverflowError:  # an int beyond float range
        return 1.0
    return value if math.isfinite(value) else 1.0


def _span(docs: Sequence[int]) -> str:
    return "-" if not docs else (f"{docs[0]}" if docs[0] == docs[-1] else f"{docs[0]}-{docs[-1]}")


class HmarsEnvFactory:
    """``environment_factory`` for TRL: every call returns a fresh `MidAgentEnv` sharing backends,
    tokenizer and index cache (created on first use)."""

    def __init__(self, config: HmarsEnvConfig | None = None, tokenizer=None) -> None:
        self.config = config or HmarsEnvConfig()
        self._tokenizer = tokenizer
        self._backends: _Backends | None = None
        self.index_cache = IndexCache(self.config.index_cache)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from coordrl.data.tokens import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.tokenizer)
        return self._tokenizer

    @property
    def backends(self) -> _Backends:
        if self._backends is None:
            self._backends = _Backends(self.config)
        return self._backends

    def __call__(self) -> MidAgentEnv:
        return MidAgentEnv(self.config, self.backends, self.tokenizer, self.index_cache)

    def close(self) -> None:
        if self._backends is not None:
            shared_loop().run(self._backends.aclose())


# -- inference over all regions ------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_broadcast(text: str) -> dict[str, Any] | None:
    """Arguments of the first ``broadcast`` tool call in assistant text (``<tool_call>{json}</tool_call>``), or None."""
    for raw in _TOOL_CALL.findall(text or ""):
        if tool_call_too_deep(f"<tool_call>{raw}</tool_call>"):  # json.loads would raise RecursionError
            continue
        try:
            call = json.loads(raw)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") == "broadcast" and isinstance(call.get("arguments"), dict):
            return call["arguments"]
    return None


@dataclass
class MultiRegionResult:
    """One question answered by all K mid-agents: the merged evidence and the single answer.

    ``info`` holds question-level metrics (reward terms, ``regions``, ``pages_selected``,
    ``evidence_tokens``, ``answer_prompt_tokens``, ``model_calls`` = frozen selector + answer calls,
    ``policy_turns``, error counts); ``evidence`` one entry per merged page (``page``, ``region``,
    ``subagent``, ``documents``, ``tokens``, ``text``).
    """

    answer: str | None
    em: float
    f1: float
    recall: float
    pages: list[int]
    evidence_tokens: int
    answer_prompt_tokens: int
    model_calls: int
    regions: list[
        dict[str, Any]
    ]  # per region: region, subagents, pages, error, tool_errors, backend_errors (+ messages, info)
    info: dict[str, Any] = field(default_factory=dict)
    evidence: list[dict[str, Any]] = field(default_factory=list)


async def _answer_regions(envs: Sequence[MidAgentEnv], regions: list[dict[str, Any]]) -> MultiRegionResult:
    """Merge the regions' selected pages, answer once on region 0's environment, and total the metrics.

    Shared by `run_all_regions` and `answer_all_regions` so both report the same numbers.
    """
    answering = envs[0]
    index = answering.index
    assert index is not None
    merged = sorted({p for r in regions for p in r["pages"]}, key=lambda p: index.pages[p].token_start)
    answer = await answering._answer([index.pages[p] for p in merged])
    terms = answering._terms()
    for r, env in zip(regions, envs, strict=True):
        r["tool_errors"] = sum(env._ep.tool_errors.values())
        r["backend_errors"] = env._ep.backend_errors
    selector_calls = sum(env._ep.selector_calls for env in envs)
    answer_calls = sum(env._ep.answer_calls for env in envs)
    region_of = {s: k for k, region in enumerate(index.regions) for s in region.subagents}
    evidence = [
        {
            "page": p, "region": region_of.get(index.pages[p].subagent), "subagent": index.pages[p].subagent,
            "documents": list(index.pages[p].documents), "tokens": [index.pages[p].token_start, index.pages[p].token_end],
            "text": index.pages[p].text,
        }
        for p in merged
    ]  # fmt: skip
    info: dict[str, Any] = {
        **terms,
        "regions": index.num_regions,
        "subagents": index.num_subagents,
        "broadcasts": sum(env._ep.broadcasts for env in envs),
        "participants": sum(len(env._ep.participants) for env in envs),
        "hinted": sum(len(env._ep.hinted) for env in envs),
        "pages_selected": len(merged),
        "evidence_tokens": answering._ep.evidence_tokens,
        "answer_prompt_tokens": answering._ep.answer_prompt_tokens,
        "selector_calls": selector_calls,
        "answer_calls": answer_calls,
        "model_calls": selector_calls + answer_calls,
        "endpoint_calls": sum(env._ep.endpoint_calls for env in envs),
        "tool_errors": sum(r["tool_errors"] for r in regions),
        "backend_errors": sum(env._ep.backend_errors for env in envs),
        "parse_failures": sum(env._ep.parse_failures for env in envs),
        **{k: sum(getattr(env._ep, k) for env in envs) for k in ROLE_ERROR_KEYS},
        "regions_failed": sum(1 for r in regions if r.get("error")),
    }
    return MultiRegionResult(
        answer=answer.text if answer.ok else None,
        em=terms["em"],
        f1=terms["f1"],
        recall=terms["recall"],
        pages=merged,
        evidence_tokens=answering._ep.evidence_tokens,
        answer_prompt_tokens=answering._ep.answer_prompt_tokens,
        model_calls=selector_calls + answer_calls,
        regions=regions,
        info=info,
        evidence=evidence,
    )


async def run_all_regions(
    env_factory: HmarsEnvFactory,
    policy_fn: Callable[[list[dict[str, Any]]], Awaitable[str]],
    row: dict[str, Any],
    parse_fn: Callable[[str], dict[str, Any] | None] = parse_broadcast,
) -> MultiRegionResult:
    """Run every mid-agent of ``row``'s document with the same policy, concurrently, and answer once.

    Each region gets its own environment bound to that region; the policy sees exactly the training
    prompt (`hmars_prompt` + the region's memory) and its first ``broadcast`` call is executed as
    selection only. The selected pages of all regions are deduplicated and ordered by offset and
    the answer backend answers from them once. A region whose policy reply has no valid broadcast
    contributes no pages (its error is reported).

    This is the text-level form for policies that are plain ``messages -> text`` callables; trained
    policies go through `answer_all_regions`, which renders and parses with TRL exactly as training.

    Args:
        env_factory: the factory (its backends, tokenizer and index cache are shared).
        policy_fn: async ``messages -> assistant text`` (e.g. an OpenAI-compatible policy call).
        row: a dataset row (``question``, ``context``, ``doc_offsets``, ``answers``, ``gold_documents``).
        parse_fn: ``assistant text -> broadcast arguments or None`` (default: `parse_broadcast`).
    """
    first = env_factory()
    first.reset(**row)
    assert first.index is not None
    envs = [first] + [env_factory() for _ in range(first.index.num_regions - 1)]
    for env in envs[1:]:
        env.reset(**row)  # the index comes from the shared cache: no second build

    async def one(k: int, env: MidAgentEnv) -> dict[str, Any]:
        memory = env._bind_region(k)
        messages = hmars_prompt(row["question"])
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + memory}
        out: dict[str, Any] = {"region": k, "subagents": env._region_subagents, "pages": [], "error": None}
        try:
            text = await policy_fn(messages)
        except Exception as exc:
            out["error"] = f"policy failed: {type(exc).__name__}: {exc}"
            return out
        args = parse_fn(text)
        if args is None:
            out["error"] = "no broadcast tool call in the policy reply"
            return out
        try:
            interp, by_sub = env._checked(args.get("interpretation"), args.get("hints"))
        except ToolInputError as err:
            env._ep.tool_errors[err.kind] = env._ep.tool_errors.get(err.kind, 0) + 1
            out["error"] = str(err)
            return out
        selections = await env._select(interp, by_sub)
        env._ep.broadcasts += 1
        out["pages"] = [p.index for p in env._merge(selections)]
        return out

    regions = list(await asyncio.gather(*(one(k, env) for k, env in enumerate(envs))))
    return await _answer_regions(envs, regions)


class _RegionMidAgent(MidAgentEnv):
    """A mid-agent bound to region ``region`` whose ``broadcast`` selects pages but does not answer.

    At inference the K regions' evidence is merged and answered once (`answer_all_regions`), so a
    region's tool call must stop after selection. The tool keeps the training method's name,
    signature and docstring: TRL renders the tool schema from them, and the prompt must be the
    token sequence the policy was trained on.
    """

    def __init__(
        self, config: HmarsEnvConfig, backends: _Backends, tokenizer, index_cache: IndexCache, region: int
    ) -> None:
        super().__init__(config, backends, tokenizer, index_cache)
        self._region_k = region

    def reset(self, **row: Any) -> str:
        super().reset(**row)  # loads the index (from the shared cache after the first region)
        return "\n\n" + self._bind_region(self._region_k)

    async def broadcast(self, interpretation: str, hints: dict[str, str]) -> str:
        try:
            interp, by_sub = self._checked(interpretation, hints)
        except ToolInputError as err:
            self._ep.tool_errors[err.kind] = self._ep.tool_errors.get(err.kind, 0) + 1
            return f"Error: {err}"
        selections = await self._select(interp, by_sub)
        pages = self._merge(selections)
        self._ep.pages = [p.index for p in pages]
        self._ep.broadcasts += 1
        return self._observe(selections, pages, None)

    broadcast.__doc__ = MidAgentEnv.broadcast.__doc__


def answer_all_regions(
    factory: HmarsEnvFactory,
    codec: Any,
    policy: Any,
    row: dict[str, Any],
    *,
    max_turns: int,
    max_completion_tokens: int | None = None,
    prompt_fn: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None,
    concurrency: int | None = None,
) -> MultiRegionResult:
    """Answer ``row`` with a trained mid-agent policy over all K regions of its document.

    The inference and evaluation path of ``protocol: hmars``. Each region runs in its own `StepEnv`
    (the policy tokenizer's `ChatCodec`: TRL's rendering and tool-call parsing, as in training) on
    a `_RegionMidAgent` bound to that region; the K regions run concurrently in threads (an
    in-process model serialises its generations; a served one batches them). A region's episode
    ends at its first successful broadcast (selection only); after a refused broadcast the policy
    sees the error and may retry, up to ``max_turns`` tool rounds, as in training. A region whose
    policy never broadcasts contributes no pages and reports why. The answer model then answers
    once from the merged, offset-ordered pages (`_answer_regions`).

    Args:
        factory: the environment factory (backends, tokenizer and index cache are shared).
        codec: the policy tokenizer's `coordrl.envs.chat.ChatCodec`.
        policy: an object with ``act(step_env) -> ids | text`` (`HFPolicy`, `OpenAIPolicy`, ...).
        row: ``question``, ``context`` (+ ``doc_offsets``, ``answers``, ``gold_documents`` when known).
        max_turns: tool rounds allowed per region.
        max_completion_tokens: cap on a region's turns and tool results (None: none).
        prompt_fn: the ``[system, user]`` prompt of a row (default: `hmars_prompt`).
        concurrency: regions in flight (default: all K).
    """
    from concurrent.futures import ThreadPoolExecutor

    from coordrl.envs.step import StepEnv

    prompt_fn = prompt_fn or (lambda r: hmars_prompt(r["question"]))
    probe = factory()
    probe.reset(**row)  # builds (or loads) the index once; every region then reads it from the cache
    assert probe.index is not None
    k_regions = probe.index.num_regions

    def one(k: int) -> tuple[dict[str, Any], MidAgentEnv]:
        env = _RegionMidAgent(factory.config, factory.backends, factory.tokenizer, factory.index_cache, k)
        step_env = StepEnv(
            env, codec, max_turns=max_turns, max_completion_tokens=max_completion_tokens,
            reward_fn=lambda completions, **kw: [env.get_reward()], prompt_fn=prompt_fn, require_stop=False,
        )  # fmt: skip
        step_env.reset(**row)
        out: dict[str, Any] = {"region": k, "subagents": env._region_subagents, "pages": [], "error": None}
        try:
            for _ in range(max_turns + 1):
                action = policy.act(step_env)
                if not action and not isinstance(action, str):
                    step_env.truncate()
                    out["error"] = "the policy produced no tokens (completion budget spent)"
                    break
                step = step_env.step(action)
                if env._ep.broadcasts:  # selection done: the answer comes once, from all regions
                    break
                if step.terminated or step.truncated:
                    out["error"] = "no broadcast: the policy " + (
                        "replied without a tool call" if step.terminated else "ran out of tool rounds"
                    )
                    break
        except Exception as exc:
            out["error"] = f"policy failed: {type(exc).__name__}: {exc}"
        out["pages"] = list(env._ep.pages)
        out["messages"] = step_env.messages
        out["info"] = {
            k2: step_env.info[k2] for k2 in ("tool_rounds", "tool_failures", "assistant_turns", "completion_tokens")
        }
        return out, env

    workers = max(1, min(k_regions, concurrency or k_regions))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coordrl-hmars-region") as pool:
        done = list(pool.map(one, range(k_regions)))
    regions = [r for r, _ in done]
    envs = [env for _, env in done]
    result = shared_loop().run(_answer_regions(envs, regions))
    result.info.update(
        policy_turns=sum(r["info"]["assistant_turns"] for r in regions),
        tool_rounds=sum(r["info"]["tool_rounds"] for r in regions),
        completion_tokens=sum(r["info"]["completion_tokens"] for r in regions),
    )
    return result
