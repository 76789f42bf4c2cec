"""The frozen roles of the HMARS environment: the page selector, the answer model and the card
writer's endpoint, shared by every environment of a factory.

Each role is lexical (model-free, in process) or an OpenAI-compatible chat endpoint; `Backends`
holds one endpoint (one connection pool) per model role and turns their replies into a `Selection`
per sub-agent and one `Answer`, counting failures and unparseable replies instead of raising.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordrl.data.hmars_world import answer_from_evidence, earlier_born, parse_question
from coordrl.data.world_reader import QUERIES, READER_UNKNOWN, grounded, reply_value, world_documents
from coordrl.envs.hmars_config import _SUB_ID, HmarsEnvConfig
from coordrl.envs.hmars_index import Page, make_chat_endpoint, parse_json_object
from coordrl.envs.hmars_prompts import selector_messages
from coordrl.readers.base import ReaderResult, chunk_key
from coordrl.readers.chat_endpoint import ChatEndpoint
from coordrl.readers.lexical import LexicalReader, content_words, split_chunk_sentences, split_sentences
from coordrl.readers.prompt import reader_messages, sanitize_reader_text
from coordrl.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN, extract_answer

__all__ = ["RULE_ANSWERER", "Answer", "Backends", "ReaderChainAnswerer", "RuleAnswerer", "Selection"]


@dataclass
class Selection:
    """One sub-agent's selection: page ids with confidences, or an error."""

    subagent: int
    pages: list[int] = field(default_factory=list)
    confidence: dict[int, float] = field(default_factory=dict)
    ok: bool = True
    error: str | None = None
    parse_failed: bool = False
    model_call: bool = False


@dataclass
class Answer:
    text: str
    ok: bool = True
    error: str | None = None
    model_call: bool = False
    parse_failed: bool = False


RULE_ANSWERER = "rule"


class RuleAnswerer:
    """The ``answerer: rule`` role: a model-free answer model for the HMARS world
    (`coordrl.data.hmars_world`), with the chat endpoint's interface (``chat``, ``aclose``).

    It reads the answer prompt `answer_messages` builds (``Evidence: ... Question: ...``) and replies
    ``<answer>...</answer>`` with `answer_from_evidence`: the world's fact sentences of the selected
    pages, followed along the question's chain, ``Unknown`` when a fact is missing. Nothing is guessed,
    so its exact match says whether the mid-agent's broadcast got the evidence selected; on any other
    data it answers ``Unknown``.
    """

    def __init__(self) -> None:
        self.calls = 0

    async def chat(
        self, conversations: Sequence[Sequence[Mapping[str, str]]], keys: Sequence[str] | None = None
    ) -> list[ReaderResult]:
        out = []
        for messages in conversations:
            self.calls += 1
            evidence, _, question = messages[-1]["content"].rpartition("\n\nQuestion: ")
            out.append(ReaderResult(f"{ANSWER_OPEN}{answer_from_evidence(question, evidence)}{ANSWER_CLOSE}"))
        return out

    async def aclose(self) -> None:
        return None


class ReaderChainAnswerer:
    """The ``answer_chain`` role: the answer model is a chunk reader (the world reader model) served
    behind ``endpoint``, asked one hop of the question at a time; the chat endpoint's interface
    (``chat``, ``aclose``).

    From the answer prompt `answer_messages` builds (``Evidence: ... Question: ...``) it takes the
    question and the selected pages, cuts the pages into their whole world documents, and asks the
    reader each hop (`coordrl.data.world_reader.QUERIES`: the lead queries it was trained on) about
    every document, one request per document in the reader prompt (`reader_messages`). Bridge: the
    director the reader states for the film, then the city it states for that director; comparison:
    both birth decades, then the earlier-born name. The model does the reading; the hops and where a
    value sits in the reader's reply sentence (`reply_value`) are the world's templates. A reply that
    is not a sentence copied from its own document (`grounded`: the reader replies extractively, so
    anything else is a misreading, e.g. of a document kind it was never trained on) states no value
    and is counted in ``ungrounded``. A hop no document answers gives ``Unknown``; a failed request
    fails the answer (the answerer's error). Questions that are not the world's are answered
    ``Unknown`` without a request.
    """

    def __init__(self, endpoint: ChatEndpoint) -> None:
        self.endpoint = endpoint
        self.calls = 0
        self.ungrounded = 0

    async def _hop(self, relation: str, subject: str, documents: Sequence[str], keys: Sequence[str]) -> str | None:
        """The value stated by the first document (in order) whose grounded reply states one; raises
        `_HopFailed` when a request failed. ``keys``: the documents' `chunk_key`."""
        query = QUERIES[relation](subject)
        results = await self.endpoint.chat([reader_messages(d, query) for d in documents], keys)
        self.calls += len(results)
        values = []
        for document, r in zip(documents, results, strict=True):
            if not r.ok:
                raise _HopFailed(r.error or "request failed")
            if (value := reply_value(r.text, relation, subject)) is None:
                continue
            if grounded(r.text, document):
                values.append(value)
            else:
                self.ungrounded += 1
        return values[0] if values else None

    async def _answer(self, question: str, evidence: str) -> str:
        parsed = parse_question(question)
        documents = world_documents(evidence)
        if parsed is None or not documents:
            return READER_UNKNOWN
        keys = [chunk_key(d) for d in documents]
        kind, names = parsed
        if kind == "bridge":
            director = await self._hop("director", names[0], documents, keys)
            city = await self._hop("city", director, documents, keys) if director else None
            return city or READER_UNKNOWN
        first, second = await asyncio.gather(*(self._hop("decade", n, documents, keys) for n in names))
        return earlier_born(names, first, second)

    async def chat(
        self, conversations: Sequence[Sequence[Mapping[str, str]]], keys: Sequence[str] | None = None
    ) -> list[ReaderResult]:
        out = []
        for messages in conversations:
            evidence, _, question = messages[-1]["content"].rpartition("\n\nQuestion: ")
            try:
                answer = await self._answer(question, evidence)
            except _HopFailed as e:
                out.append(ReaderResult("", ok=False, error=f"reader chain: {e}"))
                continue
            out.append(ReaderResult(f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"))
        return out

    async def aclose(self) -> None:
        await self.endpoint.aclose()


class _HopFailed(Exception):
    """A hop's reader request failed after its retries."""


class Backends:
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
        self.answerer = (
            RuleAnswerer()
            if c.answerer.strip() == RULE_ANSWERER
            else make_chat_endpoint(
                c.answerer, c.answerer_model, c.answerer_api_key_env, max_tokens=c.answerer_max_tokens, **common
            )
        )
        if c.answer_chain:
            self.answerer = ReaderChainAnswerer(self.answerer)
        self.lexical = LexicalReader(threshold=0.0)

    # -- selection ---------------------------------------------------------------------------------

    def _lexical_select(self, pages: Sequence[Page], parts: Sequence[str]) -> Selection:
        """Score each page by the best LexicalReader coverage over the query parts (question,
        interpretation, hint: each alone, so a precise hint is not diluted by a long question; with
        ``lexical_query_sentences`` each of their sentences alone), keep the top ``pages_per_subagent``
        at or above the threshold."""
        c = self.config
        if c.lexical_query_sentences:
            parts = [sentence for part in parts for sentence in split_sentences(part)]
        scored = []
        for page in pages:
            key = f"hmars-page:{page.index}:{page.char_start}:{len(page.text)}"
            best = max((self.lexical.score(q, page.text, key)[0] for q in parts if q.strip()), default=0.0)
            scored.append((best, page.index))
        kept = sorted(
            (s for s in scored if s[0] >= c.lexical_select_threshold and s[0] > 0), key=lambda s: (-s[0], s[1])
        )[: c.pages_per_subagent]
        return Selection(pages[0].subagent if pages else -1, [p for _, p in kept], {p: round(s, 4) for s, p in kept})

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
    ) -> list[Selection]:
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
                out.append(Selection(sub, ok=False, error=res.error, model_call=True))
                continue
            parsed = self._parse_selection(res.text, {p.index for p in pages})
            if parsed is None:  # an unparseable reply still gets the sub-agent's pages considered
                sel = self._lexical_select(pages, [question, interp or "", hint or ""])
                sel.subagent, sel.parse_failed, sel.model_call = sub, True, True
                out.append(sel)
            else:
                out.append(Selection(sub, parsed[0], parsed[1], model_call=True))
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

    async def answer(self, question: str, pages: Sequence[Page], messages: list[dict[str, str]]) -> Answer:
        if self.answerer is None:
            return Answer(self._lexical_answer(question, pages))
        res = (await self.answerer.chat([messages], ["answer"]))[0]
        if not res.ok:
            return Answer("", ok=False, error=res.error, model_call=True)
        tagged = extract_answer(res.text)
        # A reply without the tag still answers; it is counted so a bad answer prompt shows up.
        return Answer(
            tagged if tagged is not None else " ".join(res.text.split())[:300],
            model_call=True,
            parse_failed=tagged is None,
        )

    async def aclose(self) -> None:
        for endpoint in (self.writer, self.selector, self.answerer):
            if endpoint is not None:
                await endpoint.aclose()


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
