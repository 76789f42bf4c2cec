"""One HMARS mid-agent episode as a plain object with a public API (`MidAgentEpisode`).

The TRL environment (`coordrl.envs.hmars.MidAgentEnv`) is a thin adapter over it, and multi-region
inference composes its steps (bind a region, broadcast without answering, answer once from every
region's pages) through the same methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordrl.envs.hmars_config import _SUB_ID, ROLE_ERROR_KEYS, HmarsEnvConfig
from coordrl.envs.hmars_index import DocumentIndex, IndexCache, Page, build_index, index_key
from coordrl.envs.hmars_prompts import answer_messages, hmars_user_message
from coordrl.envs.hmars_roles import Answer, Backends, Selection
from coordrl.envs.tool_input import ToolInputError, check_text, safe_str
from coordrl.readers.loop import shared_loop
from coordrl.readers.prompt import sanitize_reader_text
from coordrl.rewards.metrics import exact_match, f1_score

__all__ = ["EpisodeStats", "MidAgentEpisode", "observation_token_bound"]


@dataclass
class EpisodeStats:
    """What one mid-agent episode did: calls, failures per role, participants, selections, evidence."""

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
    selections: dict[int, Selection] = field(default_factory=dict)
    pages: list[int] = field(default_factory=list)
    evidence_tokens: int = 0
    answer_prompt_tokens: int = 0
    answer: str | None = None
    selector_inputs: list[dict[str, Any]] = field(default_factory=list)

    def count_role_reply(self, role: str, reply: Selection | Answer) -> None:
        """Count one reply of the frozen ``role`` (``selector`` or ``answerer``): whether a model
        endpoint answered it, and its failure or unparsed output, under the role's name and in total."""
        failed, unparsed = int(not reply.ok), int(reply.parse_failed)
        self.endpoint_calls += int(reply.model_call)
        setattr(self, f"{role}_errors", getattr(self, f"{role}_errors") + failed)
        setattr(self, f"{role}_parse_failures", getattr(self, f"{role}_parse_failures") + unparsed)
        self.backend_errors += failed
        self.parse_failures += unparsed


class MidAgentEpisode:
    """One HMARS mid-agent episode as a plain object: the document index, one bound region, and the
    broadcast -> selection -> answer pipeline, with public steps that the TRL environment
    (`coordrl.envs.hmars.MidAgentEnv`) and multi-region inference (`answer_all_regions`) compose.

    ``start(row)`` takes a dataset row with ``question``, ``answers`` (or ``answer``),
    ``gold_documents``, ``context`` and ``doc_offsets``; ``bind_region(k)`` starts a fresh episode
    on region ``k`` and returns its memory; `broadcast` runs the whole tool; `reward`, `terms` and
    `info` report it.
    """

    def __init__(self, config: HmarsEnvConfig, backends: Backends, tokenizer, index_cache: IndexCache) -> None:
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
        self.stats = EpisodeStats()

    def start(self, row: dict[str, Any]) -> None:
        """Load ``row``'s index (built once, then from the shared cache) and bind region 0.

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
        self.bind_region(0)

    async def broadcast(self, interpretation: Any, hints: Any, *, answer: bool = True) -> str:
        """The ``broadcast`` tool: check the arguments, let the region's sub-agents select pages, merge
        them and (with ``answer``) have the answer model answer from them. Returns the observation
        the policy reads; refused arguments return ``Error: ...`` and are counted by kind.

        ``answer=False`` stops after selection (multi-region inference answers once, from every
        region's pages); the merged pages are still recorded in ``stats.pages``.
        """
        try:
            interp, by_sub = self.check(interpretation, hints)
        except ToolInputError as err:
            self.record_tool_error(err)
            return f"Error: {err}"
        selections = await self.select(interp, by_sub)
        pages = self.merge(selections)
        if answer:
            reply = await self.answer_from(pages)
        else:
            self.stats.pages, reply = [p.index for p in pages], None
        self.stats.broadcasts += 1
        return self.observe(selections, pages, reply)

    def record_tool_error(self, err: ToolInputError) -> None:
        self.stats.tool_errors[err.kind] = self.stats.tool_errors.get(err.kind, 0) + 1

    @property
    def reward(self) -> float:
        """Exact match of the answer model's answer (+ recall and budget terms when weighted)."""
        return float(self.terms()["reward"])

    # -- reporting -----------------------------------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        """Per-episode metrics (floats and ints only): reward terms, evidence, calls, errors."""
        ep, idx = self.stats, self._index
        region = self.region_subagents
        return {
            **self.terms(),
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
        return dict(self.stats.tool_errors)

    @property
    def selections(self) -> dict[str, list[int]]:
        """Selected page ids per participating sub-agent id."""
        return {f"s{s}": list(sel.pages) for s, sel in self.stats.selections.items()}

    @property
    def selector_inputs(self) -> list[dict[str, Any]]:
        """What each selector was given this episode: subagent, interpretation, hint (None when withheld)."""
        return list(self.stats.selector_inputs)

    @property
    def answer(self) -> str | None:
        return self.stats.answer

    @property
    def index(self) -> DocumentIndex | None:
        return self._index

    @property
    def sample(self) -> dict[str, Any]:
        return self._row

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

    def bind_region(self, group: int) -> str:
        """Bind mid-agent region ``group`` (inference runs every group; training uses 0) and start a
        fresh episode on it. Returns the regional memory text (with ``question_after_memory``,
        followed by ``Question: <question>``)."""
        if self._index is None:
            raise RuntimeError("start() first")
        if not 0 <= group < self._index.num_regions:
            raise ValueError(f"region {group} out of range: the document has {self._index.num_regions}")
        self._group = group
        self.stats = EpisodeStats()
        # Titles, entities and model-written summaries in the memory are document text: data, never
        # markers (a title cannot close the prompt's user turn or carry an answer tag).
        memory = self._index.region_text(
            group,
            card_summaries=self._config.memory_card_summaries,
            title_index=self._config.memory_title_index,
            submap=self._config.memory_map,
        )
        # The question again, right before the broadcast the policy writes (``question_after_memory``).
        if self._config.question_after_memory:
            memory += "\n" + hmars_user_message(self._question)
        return sanitize_reader_text(memory)

    @property
    def region_subagents(self) -> list[int]:
        """Sub-agent ids of the bound region."""
        return list(self._index.regions[self._group].subagents) if self._index else []

    def _gold_in_region(self) -> float:
        if not self._gold_docs or self._index is None:
            return 0.0
        docs = {
            d
            for s in self.region_subagents
            for p in self._index.subagent_pages[s]
            for d in self._index.pages[p].documents
        }
        return len(self._gold_docs & docs) / len(self._gold_docs)

    def check(self, interpretation: Any, hints: Any) -> tuple[str, dict[int, str]]:
        """Checked ``(interpretation, {sub-agent: hint})``: `_validate`, with any other exception (an argument object that breaks while being read)
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
        if self.stats.broadcasts:
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
        region = set(self.region_subagents)
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
        for sub in self.region_subagents:
            if mode == "dispatch" and sub not in by_sub:
                continue
            interp_in, hint_in = (None, None) if mode == "no_mid" else (interp, by_sub.get(sub, interp))
            pages = [self._index.pages[p] for p in self._index.subagent_pages[sub]]
            jobs.append((sub, pages, self._index.cards[sub].text(), interp_in, hint_in))
        return jobs

    async def select(self, interp: str, by_sub: dict[int, str]) -> list[Selection]:
        """Every participating sub-agent of the region selects pages (per the mode), concurrently."""
        ep = self.stats
        jobs = self._jobs(interp, by_sub)
        ep.hinted = sorted(by_sub)
        ep.participants = [j[0] for j in jobs]
        ep.selector_inputs = [{"subagent": j[0], "interpretation": j[3], "hint": j[4]} for j in jobs]
        selections = await shared_loop().run_async(self._backends.select(self._question, jobs)) if jobs else []
        for sel in selections:
            ep.selector_calls += 1
            ep.count_role_reply("selector", sel)
            ep.selections[sel.subagent] = sel
        return selections

    def merge(self, selections: Sequence[Selection]) -> list[Page]:
        """The selected pages, deduplicated and in document order."""
        assert self._index is not None
        ids = sorted(
            {p for sel in selections if sel.ok for p in sel.pages}, key=lambda p: self._index.pages[p].token_start
        )
        return [self._index.pages[p] for p in ids]

    def _count(self, messages: Sequence[dict[str, str]]) -> int:
        return sum(len(self._tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages)

    async def answer_from(self, pages: Sequence[Page]) -> Answer:
        """The answer model's answer from ``pages``; records the evidence and the answer."""
        ep = self.stats
        messages = answer_messages(
            self._question, [(f"page {p.index} | Documents {_span(p.documents)}", p.text) for p in pages]
        )
        ep.pages = [p.index for p in pages]
        ep.evidence_tokens = sum(p.num_tokens for p in pages)
        ep.answer_prompt_tokens = self._count(messages)
        answer = await shared_loop().run_async(self._backends.answer(self._question, pages, messages))
        ep.answer_calls += 1
        ep.count_role_reply("answerer", answer)
        ep.answer = answer.text if answer.ok else None
        return answer

    def observe(self, selections: Sequence[Selection], pages: Sequence[Page], answer: Answer | None) -> str:
        assert self._index is not None
        lines = [_header_line(len(selections), len(self.region_subagents), self._config.mode)]
        for sel in selections:
            if not sel.ok:
                lines.append(
                    f"- s{sel.subagent}: unavailable (selector error: {sanitize_reader_text(safe_str(sel.error, 160))})"
                )
            elif not sel.pages:
                lines.append(f"- s{sel.subagent}: no page selected")
            else:
                refs = [(p, _span(self._index.pages[p].documents)) for p in sel.pages]
                lines.append(_pages_line(sel.subagent, refs))
        lines.append(_evidence_line(len(pages), sum(p.num_tokens for p in pages)))
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

    def terms(self) -> dict[str, float]:
        """The reward and its parts: ``em``, ``f1``, ``recall``, ``recall_term``, ``budget_term``."""
        c, ep = self._config, self.stats
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


def _header_line(selected: int, subagents: int, mode: str) -> str:
    return f"{selected} of {subagents} sub-agents selected pages (mode {mode})."


def _pages_line(subagent: int, refs: Sequence[tuple[int, str]]) -> str:
    return f"- s{subagent}: " + ", ".join(f"page {page} (Documents {span})" for page, span in refs)


def _evidence_line(pages: int, tokens: int) -> str:
    return f"Evidence: {pages} page(s), {tokens} tokens."


# The widest number the bound renders: sub-agent, page and Document numbers below 10,000.
_WIDEST = 9_999


def observation_token_bound(config: HmarsEnvConfig) -> int:
    """Upper bound, in policy tokens, of one broadcast result (`MidAgentEpisode.observe`) when the
    selectors answer: all ``group_size`` sub-agents select ``pages_per_subagent`` pages each (numbers
    of up to four digits), then the answer line with ``answerer_max_tokens`` tokens of answer.

    The fixed text counts one token per UTF-8 byte, a true bound for byte-level BPE tokenizers (every
    token covers at least one byte); the answer one policy token per answerer token. A failed
    selector's line can be longer (its error, up to 160 characters), so an episode whose roles fail
    may be cut off; it has failed already.
    """
    g, k = config.group_size, config.pages_per_subagent
    refs = [(_WIDEST, f"{_WIDEST}-{_WIDEST}")] * k
    lines = [_header_line(g, g, config.mode), *[_pages_line(_WIDEST, refs)] * g]
    lines += [_evidence_line(g * k, _WIDEST * 100), "Answer: "]
    return len("\n".join(lines).encode()) + config.answerer_max_tokens


def _span(docs: Sequence[int]) -> str:
    return "-" if not docs else (f"{docs[0]}" if docs[0] == docs[-1] else f"{docs[0]}-{docs[-1]}")
