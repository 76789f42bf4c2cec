"""HMARS indexing: pages, sub-agent regions, memory cards and regional memories, cached on disk.

A document is cut into pages of at most ``page_tokens`` tokens with `chunk_context` (so pages keep
their global token and character spans and the Document numbers they cover), and consecutive pages
are grouped into sub-agent regions of at most ``c_sub`` tokens (``c_sub // page_tokens`` pages).
Sub-agents are grouped under mid-agents, ``group_size`` at a time (K = ceil(M / G)).

Each sub-agent gets a memory card (summary, topics, entities, page index) and each group a regional
memory (summary, sub-agent map, cross-references), written by a *writer*: ``lexical`` (keywords,
capitalised entities, titles and first sentences; deterministic, no model) or an OpenAI-compatible
chat endpoint whose JSON reply is parsed; a reply that does not parse, or an endpoint that fails
after its retries, falls back to the lexical card and is counted in the index's ``stats``.

Indexes are JSON files (never pickles) under ``cache_dir``, named by the sha256 of the content,
the writer model and every setting that changes the result, so training and evaluation never
rebuild them and a changed setting never serves a stale index. Page text is not stored: it is
re-cut from the context by character span on load.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from coordrl.data.chunk import chunk_context
from coordrl.data.errors import DataError
from coordrl.data.show import load_built
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.hmars_prompts import card_writer_messages, region_writer_messages
from coordrl.readers.base import ReaderResult
from coordrl.readers.chat_client import DEFAULT_API_KEY_ENV
from coordrl.readers.chat_endpoint import ChatEndpoint, make_chat_endpoint
from coordrl.readers.lexical import _STOPWORDS, split_chunk_sentences
from coordrl.readers.loop import shared_loop

__all__ = [
    "INDEX_VERSION",
    "MEMORY_SUMMARY_CHARS",
    "TITLE_INDEX_CHARS",
    "TITLE_INDEX_HEADER",
    "ChatEndpoint",
    "DocumentIndex",
    "IndexCache",
    "IndexSettings",
    "MemoryCard",
    "Page",
    "RegionalMemory",
    "build_index",
    "build_indexes",
    "index_key",
    "make_chat_endpoint",
    "parse_json_object",
    "partition",
]

INDEX_VERSION = 1  # bump when the index layout or the lexical writer changes: old cache files stop matching
# Characters of one sub-agent's card summary in the mid-agent's observation (``memory_card_summaries``).
# 600 is the lexical writer's own summary cap (`IndexSettings.summary_chars`), so a lexical summary (its
# titles with their first sentences) is shown whole; a model-written summary may run to twice that and is
# cut to the same size, so a full group of G = 10 sub-agents adds at most about 6,000 characters (about
# 2,000 tokens with the shipped tokenizer) to the policy's prompt, whatever the writer.
MEMORY_SUMMARY_CHARS = 600
# The title index line of the mid-agent's observation (``memory_title_index``): its head, and its cap.
# A full group of G = 10 sub-agents of 16,384 tokens holds about 1,600 HotpotQA paragraphs, whose
# index would run to about 8,000 tokens; 4,000 characters (about 1,000 tokens, some 200 titles) keeps
# it within the card summaries' own budget, and the line says how many titles it left out.
TITLE_INDEX_HEADER = "Document titles by sub-agent:"
TITLE_INDEX_CHARS = 4000


# -- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexSettings:
    """What an index depends on (all of it goes into the cache key).

    Attributes:
        c_sub: tokens per sub-agent region at most (default 16,384).
        page_tokens: tokens per page at most (default 1,024); a region holds ``c_sub // page_tokens`` pages.
        group_size: sub-agents per mid-agent, G (default 10).
        tokenizer: tokenizer spec the pages are cut with (None: coordrl's shipped tokenizer).
        writer: ``lexical`` or comma-separated OpenAI-compatible URLs.
        writer_model: model served at the writer URLs (part of the key; the URL is not, so moving
            a server does not invalidate the cache).
        writer_api_key_env: environment variable holding the writer's API key (default OPENAI_API_KEY).
        writer_max_tokens: tokens the writer may generate per card (default 512).
        writer_input_chars: characters of region text shown to the writer per card (default 48,000,
            about 12K tokens; split evenly across pages).
        card_topics / card_entities: lexical card sizes (defaults 8 and 16).
        summary_chars: characters of a lexical summary at most (default 600).
    """

    c_sub: int = 16384
    page_tokens: int = 1024
    group_size: int = 10
    tokenizer: str | None = None
    writer: str = "lexical"
    writer_model: str | None = None
    writer_api_key_env: str | None = DEFAULT_API_KEY_ENV
    writer_max_tokens: int = 512
    writer_input_chars: int = 48000
    card_topics: int = 8
    card_entities: int = 16
    summary_chars: int = 600

    def __post_init__(self) -> None:
        if self.page_tokens < 1 or self.c_sub < self.page_tokens:
            raise DataError(f"need 1 <= page_tokens <= c_sub, got page_tokens={self.page_tokens}, c_sub={self.c_sub}")
        if self.group_size < 1:
            raise DataError(f"group_size must be positive, got {self.group_size}")
        if not self.is_lexical and not self.writer_model:
            raise DataError("a writer URL needs the served model name (--writer-model)")

    @classmethod
    def of(cls, settings: object) -> IndexSettings:
        """The index part of ``settings`` (a wider config, or a command line's flags): every field
        of this class it has an attribute of, by name; the others keep their defaults."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)})

    @property
    def is_lexical(self) -> bool:
        return self.writer.strip() == "lexical"

    @property
    def pages_per_subagent(self) -> int:
        return self.c_sub // self.page_tokens

    def key_fields(self) -> dict[str, Any]:
        """Settings that change the index (URL and API key excluded on purpose)."""
        d = asdict(self)
        d.pop("writer")
        d.pop("writer_api_key_env")
        d["writer_model"] = "lexical" if self.is_lexical else self.writer_model
        d["tokenizer"] = self.tokenizer or "coordrl-tiny"
        if self.is_lexical:  # model-only knobs must not split the lexical cache
            d.pop("writer_max_tokens")
            d.pop("writer_input_chars")
        return d


def index_key(context: str, doc_offsets: Sequence[int] | None, settings: IndexSettings) -> str:
    """sha256 over (index version, content, Document offsets, writer model, settings)."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {"v": INDEX_VERSION, "settings": settings.key_fields(), "doc_offsets": list(doc_offsets or ())},
            sort_keys=True,
        ).encode()
    )
    h.update(b"\0")
    h.update(context.encode("utf-8"))
    return h.hexdigest()


# -- index objects --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """One page. ``index`` is global over the document (the page id sub-agents select)."""

    index: int
    subagent: int
    text: str
    token_start: int
    token_end: int
    char_start: int
    char_end: int
    documents: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass
class MemoryCard:
    """A sub-agent's card: what it holds, shown to its mid-agent (never used as evidence)."""

    subagent: int
    summary: str
    topics: list[str]
    entities: list[str]
    page_index: list[dict[str, Any]]  # per page: page, tokens [start, end), documents [first, last], gist
    written_by: str = "lexical"

    def text(self) -> str:
        """Compact rendering for selector prompts."""
        pages = "; ".join(f"page {p['page']}: {p.get('gist', '')}" for p in self.page_index)
        return f"Summary: {self.summary}\nTopics: {', '.join(self.topics)}\nEntities: {', '.join(self.entities)}\nPages: {pages}"


@dataclass
class RegionalMemory:
    """A mid-agent's shared memory over its group of sub-agents."""

    group: int
    subagents: list[int]
    summary: str
    submap: dict[str, dict[str, Any]]  # "s3" -> {documents, pages, topics, entities}
    crossref: list[dict[str, Any]]  # [{"entity": str, "subagents": ["s1", "s4"]}]
    written_by: str = "lexical"


@dataclass
class DocumentIndex:
    """Everything the mid-agent environment needs about one document."""

    key: str
    settings: dict[str, Any]
    num_tokens: int
    pages: list[Page]
    subagent_pages: list[list[int]]  # sub-agent i -> its page ids
    cards: list[MemoryCard]
    regions: list[RegionalMemory]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_subagents(self) -> int:
        return len(self.subagent_pages)

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": INDEX_VERSION,
            "key": self.key,
            "settings": self.settings,
            "num_tokens": self.num_tokens,
            "pages": [
                {k: v for k, v in asdict(p).items() if k != "text"} | {"documents": list(p.documents)}
                for p in self.pages
            ],
            "subagent_pages": self.subagent_pages,
            "cards": [asdict(c) for c in self.cards],
            "regions": [asdict(r) for r in self.regions],
            "stats": self.stats,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], context: str) -> DocumentIndex:
        if data.get("version") != INDEX_VERSION:
            raise DataError(f"index version {data.get('version')} != {INDEX_VERSION}")
        pages = [
            Page(text=context[p["char_start"] : p["char_end"]], **{**p, "documents": tuple(p["documents"])})
            for p in data["pages"]
        ]
        if pages and pages[-1].char_end != len(context):
            raise DataError("cached index does not match the context (length differs)")
        return cls(
            key=data["key"],
            settings=data["settings"],
            num_tokens=data["num_tokens"],
            pages=pages,
            subagent_pages=[list(x) for x in data["subagent_pages"]],
            cards=[MemoryCard(**c) for c in data["cards"]],
            regions=[RegionalMemory(**r) for r in data["regions"]],
            stats=dict(data.get("stats", {})),
        )

    def region_text(
        self, group: int, *, card_summaries: bool = False, title_index: bool = False, submap: bool = True
    ) -> str:
        """The regional memory the mid-agent of ``group`` sees (appended to its user message).

        ``submap`` (the ``memory_map`` setting) keeps the summary line, the sub-agent map (topics and
        entities per sub-agent) and the cross-references; off, the header is followed only by what the
        other flags add.

        ``card_summaries`` (the ``memory_card_summaries`` setting) adds one line per sub-agent after
        the sub-agent map: its card summary, whitespace collapsed and cut at `MEMORY_SUMMARY_CHARS`.
        ``title_index`` (``memory_title_index``) adds a last line naming every Document title of the
        region with the sub-agent whose pages hold its header (`title_index`), in document order, cut
        after `TITLE_INDEX_CHARS` characters with a count of the titles left out. Without either the text
        is the memory alone. The text is document text either way: the caller sanitises it
        (`MidAgentEpisode.bind_region`).
        """
        reg = self.regions[group]
        ids = [f"s{i}" for i in reg.subagents]
        lines = [f"Regional memory (mid-agent {group + 1} of {self.num_regions}; sub-agents {', '.join(ids)}):"]
        if submap:
            lines += [f"Summary: {reg.summary}", "Sub-agents:"]
            for sid in ids:
                entry = reg.submap.get(sid, {})
                docs = entry.get("documents") or []
                where = f"Documents {docs[0]}-{docs[1]}" if len(docs) == 2 else "Documents ?"
                lines.append(
                    f"- {sid} ({where}): topics: {', '.join(map(str, entry.get('topics', [])))}; "
                    f"entities: {', '.join(map(str, entry.get('entities', [])))}"
                )
        if card_summaries:
            lines.append("Sub-agent card summaries (document text, not instructions):")
            lines += [f"- s{i}: {_clip_summary(self.cards[i].summary)}" for i in reg.subagents]
        if submap and reg.crossref:
            lines.append("Cross-references:")
            lines += [f"- {x.get('entity')}: {', '.join(map(str, x.get('subagents', [])))}" for x in reg.crossref]
        if title_index:
            lines.append(_title_index_line(self.title_index(group)))
        return "\n".join(lines)

    def title_index(self, group: int) -> list[tuple[str, int]]:
        """``(title, sub-agent)`` for every ``Document i:`` header on the pages of region ``group``, in
        document order. Read from the pages themselves, so it is the same whatever wrote the cards: the
        map from a name to the sub-agent holding that name's own Document, which an entity list (a name
        is listed wherever it is mentioned) does not give."""
        # A dict keeps document order and drops repeats in one pass (a region can hold 1,000+ titles).
        found = {
            (title, i): None
            for i in self.regions[group].subagents
            for p in self.subagent_pages[i]
            for title, _ in _titled_first_sentences(self.pages[p].text)
            if title
        }
        return list(found)


def _title_index_line(pairs: Sequence[tuple[str, int]], chars: int = TITLE_INDEX_CHARS) -> str:
    """``Document titles by sub-agent: A s0; B s1; ...``, the entries that fit in ``chars`` characters
    and, when some do not, ``... (N more)``."""
    entries = [f"{' '.join(t.split())} s{i}" for t, i in pairs]
    kept, used = [], 0
    for entry in entries:
        if used + len(entry) + 2 > chars:
            break
        kept.append(entry)
        used += len(entry) + 2
    rest = len(entries) - len(kept)
    body = "; ".join(kept + ([f"... ({rest} more)"] if rest else []))
    return f"{TITLE_INDEX_HEADER} {body or '(none)'}"


def _clip_summary(summary: str, chars: int = MEMORY_SUMMARY_CHARS) -> str:
    """``summary`` on one line, cut at a word boundary to ``chars`` characters (`lexical_card`'s rule)."""
    text = " ".join(str(summary).split())
    if not text:
        return "(no summary)"
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0] + " ..."


# -- partitioning ---------------------------------------------------------------------------------


def partition(
    context: str, doc_offsets: Sequence[int] | None, tokenizer, settings: IndexSettings
) -> tuple[list[Page], list[list[int]], int]:
    """Pages (global ids, in order) and the page ids of each sub-agent, plus the document's token count."""
    chunks = chunk_context(context, tokenizer, settings.page_tokens, doc_offsets)
    per = settings.pages_per_subagent
    pages = [
        Page(c.index, c.index // per, c.text, c.token_start, c.token_end, c.char_start, c.char_end, c.documents)
        for c in chunks
    ]
    groups = [list(range(s, min(s + per, len(pages)))) for s in range(0, len(pages), per)]
    return pages, groups, chunks[-1].token_end if chunks else 0


# -- lexical writer -------------------------------------------------------------------------------

# Words of one name are joined by spaces or tabs only: across a line break a Document title would run
# into its paragraph's first word ("Mefi\nMefi was born ..." -> "Mefi Mefi").
_ENTITY = re.compile(r"\b[A-Z][\w'’\-]*(?:[ \t]+(?:of|de|von|van|the|and|&)[ \t]+[A-Z][\w'’\-]*|[ \t]+[A-Z][\w'’\-]*)*")
_NOT_ENTITIES = frozenset(
    {
        "document",
        "in",
        "it",
        "he",
        "she",
        "they",
        "this",
        "these",
        "the",
        "a",
        "an",
        "his",
        "her",
        "on",
        "at",
        "as",
        "after",
        "during",
        "for",
        "from",
        "its",
    }
    # Dates are capitalised but say nothing about what a region holds.
    | {
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
    }
    | {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"}
)


def _entities(text: str) -> Counter:
    found: Counter = Counter()
    for match in _ENTITY.finditer(text):
        ent = match.group(0).strip()
        words = ent.split()
        # Sentence-initial function words ("The", "In") are capitalised without being names.
        while words and words[0].lower() in _NOT_ENTITIES:
            words = words[1:]
        if not words or (len(words) == 1 and (words[0].lower() in _STOPWORDS or len(words[0]) < 3)):
            continue
        found[" ".join(words)] += 1
    return found


def _words(text: str) -> Counter:
    return Counter(w for w in re.findall(r"[a-z][a-z'\-]{2,}", text.lower()) if w not in _STOPWORDS)


def _doc_span(pages: Sequence[Page]) -> list[int]:
    docs = [d for p in pages for d in p.documents]
    return [min(docs), max(docs)] if docs else []


def _titled_first_sentences(text: str) -> list[tuple[str, str]]:
    """(title, first sentence) per Document block, in order."""
    seen: dict[str, str] = {}
    for title, sentence in split_chunk_sentences(text):
        if title and title not in seen:
            seen[title] = sentence
    return list(seen.items())


def lexical_card(
    subagent: int, pages: Sequence[Page], doc_freq: Counter, n_subagents: int, settings: IndexSettings
) -> MemoryCard:
    """A deterministic card: TF-IDF keywords (IDF over the document's sub-agents, so topics say what
    is distinctive here), the most frequent capitalised entities (titles first), and a summary of
    titles with their first sentences."""
    text = "".join(p.text for p in pages)
    tf = _words(text)
    topics = [
        w
        for w, _ in sorted(
            tf.items(), key=lambda kv: (-kv[1] * math.log((n_subagents + 1) / (doc_freq[kv[0]] + 0.5)), kv[0])
        )
    ][: settings.card_topics]
    titled = _titled_first_sentences(text)
    ents = _entities(text)
    entities: list[str] = []
    for title, _ in titled:  # a paragraph title is the entity the paragraph is about
        if title not in entities and len(entities) < settings.card_entities // 2:
            entities.append(title)
    for ent, _ in sorted(ents.items(), key=lambda kv: -kv[1]):
        if len(entities) >= settings.card_entities:
            break
        if ent not in entities:
            entities.append(ent)
    span = _doc_span(pages)
    head = f"Documents {span[0]}-{span[1]}. " if span else ""
    summary = head + " ".join(f"{t}: {s}" for t, s in titled[:6])
    if len(summary) > settings.summary_chars:
        summary = summary[: settings.summary_chars].rsplit(" ", 1)[0] + " ..."
    page_index = []
    for p in pages:
        titles = [t for t, _ in _titled_first_sentences(p.text)][:4]
        words = [w for w, _ in _words(p.text).most_common(4)]
        page_index.append(
            {
                "page": p.index,
                "tokens": [p.token_start, p.token_end],
                "documents": _doc_span([p]),
                "gist": "; ".join(titles) or ", ".join(words),
            }
        )
    return MemoryCard(subagent, summary, topics, entities, page_index)


def lexical_region(
    group: int, subagents: Sequence[int], cards: Sequence[MemoryCard], settings: IndexSettings
) -> RegionalMemory:
    """Regional memory from cards: summary of the group's span and common topics, a sub-agent map,
    and cross-references = entities named on two or more sub-agents' cards."""
    submap: dict[str, dict[str, Any]] = {}
    owners: dict[str, list[str]] = {}
    topic_count: Counter = Counter()
    for i, card in zip(subagents, cards, strict=True):
        sid = f"s{i}"
        docs = [d for p in card.page_index for d in p.get("documents", [])]
        pages = [p["page"] for p in card.page_index]
        submap[sid] = {
            "documents": [min(docs), max(docs)] if docs else [],
            "pages": [min(pages), max(pages)] if pages else [],
            "topics": card.topics[:6],
            "entities": card.entities[:6],
        }
        topic_count.update(card.topics)
        for ent in card.entities:
            owners.setdefault(ent, [])
            if sid not in owners[ent]:
                owners[ent].append(sid)
    crossref = [
        {"entity": e, "subagents": s} for e, s in sorted(owners.items(), key=lambda kv: -len(kv[1])) if len(s) > 1
    ][:20]
    all_docs = [d for s in submap.values() for d in s["documents"]]
    span = f"Documents {min(all_docs)}-{max(all_docs)}" if all_docs else "no Documents"
    summary = f"{len(subagents)} sub-agents covering {span}. Common topics: {', '.join(t for t, _ in topic_count.most_common(8))}."
    return RegionalMemory(group, list(subagents), summary, submap, crossref)


# -- model writer ---------------------------------------------------------------------------------


_FENCE = re.compile(r"^\s*```(?:json)?\s*|\s*```\s*$")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def parse_json_object(text: str) -> dict[str, Any] | None:
    """The JSON object in a model reply (code fences and a think block tolerated), or None."""
    text = _FENCE.sub("", _THINK.sub("", text or "")).strip()
    for candidate in (text, text[text.find("{") : text.rfind("}") + 1] if "{" in text else ""):
        if not candidate:
            continue
        try:
            value = json.loads(candidate)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return None


def _str_list(value: Any, limit: int) -> list[str] | None:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        return None
    return [" ".join(x.split())[:120] for x in value if x.strip()][:limit]


def _card_from_reply(reply: dict[str, Any] | None, fallback: MemoryCard, settings: IndexSettings) -> MemoryCard | None:
    if reply is None or not isinstance(reply.get("summary"), str) or not reply["summary"].strip():
        return None
    topics, entities = (
        _str_list(reply.get("topics"), 2 * settings.card_topics),
        _str_list(reply.get("entities"), 2 * settings.card_entities),
    )
    if topics is None or entities is None:
        return None
    gists = reply.get("page_gists") if isinstance(reply.get("page_gists"), dict) else {}
    # Page spans always come from the partition: grounding must not depend on the writer.
    page_index = [dict(p, gist=str(gists.get(str(p["page"]), p["gist"]))[:200]) for p in fallback.page_index]
    return MemoryCard(
        fallback.subagent,
        " ".join(reply["summary"].split())[: 2 * settings.summary_chars],
        topics,
        entities,
        page_index,
        "model",
    )


def _region_from_reply(reply: dict[str, Any] | None, fallback: RegionalMemory) -> RegionalMemory | None:
    if reply is None or not isinstance(reply.get("summary"), str) or not reply["summary"].strip():
        return None
    submap = dict(fallback.submap)  # spans stay deterministic; topics/entities may come from the model
    given = reply.get("submap") if isinstance(reply.get("submap"), dict) else {}
    for sid, entry in given.items():
        if sid in submap and isinstance(entry, dict):
            t, e = _str_list(entry.get("topics"), 8), _str_list(entry.get("entities"), 8)
            submap[sid] = dict(submap[sid], **({"topics": t} if t else {}), **({"entities": e} if e else {}))
    crossref = []
    for x in reply.get("crossref") if isinstance(reply.get("crossref"), list) else []:
        if isinstance(x, dict) and isinstance(x.get("entity"), str) and isinstance(x.get("subagents"), list):
            subs = [str(s) for s in x["subagents"] if str(s) in submap]
            if len(subs) > 1:
                crossref.append({"entity": x["entity"][:120], "subagents": subs})
    return RegionalMemory(
        fallback.group,
        fallback.subagents,
        " ".join(reply["summary"].split())[:1200],
        submap,
        crossref[:20] or fallback.crossref,
        "model",
    )


# -- building ---------------------------------------------------------------------------------------


async def build_index(
    context: str,
    doc_offsets: Sequence[int] | None,
    tokenizer,
    settings: IndexSettings,
    endpoint: ChatEndpoint | None = None,
    key: str | None = None,
) -> DocumentIndex:
    """Build one document's index. With ``endpoint`` the cards and regional memories are written by
    the model (all cards of the document concurrently, then all regions); otherwise lexically."""
    t0 = time.perf_counter()
    # Tokenizing a long context is the CPU-heavy part; in a thread it overlaps other documents' model calls.
    pages, groups, n_tokens = await asyncio.to_thread(partition, context, doc_offsets, tokenizer, settings)
    doc_freq: Counter = Counter()
    for ids in groups:
        doc_freq.update(set(_words("".join(pages[i].text for i in ids))))
    cards = [lexical_card(s, [pages[i] for i in ids], doc_freq, len(groups), settings) for s, ids in enumerate(groups)]
    stats: dict[str, Any] = {"writer_calls": 0, "parse_failures": 0, "backend_errors": 0, "first_error": None}
    group_ids = [
        list(range(g, min(g + settings.group_size, len(groups)))) for g in range(0, len(groups), settings.group_size)
    ]
    regions = [lexical_region(k, ids, [cards[i] for i in ids], settings) for k, ids in enumerate(group_ids)]

    def _take(results: list[ReaderResult], fallbacks: list, convert) -> list:
        out = []
        for res, fb in zip(results, fallbacks, strict=True):
            stats["writer_calls"] += 1
            if not res.ok:
                stats["backend_errors"] += 1
                stats["first_error"] = stats["first_error"] or res.error
                out.append(fb)
                continue
            made = convert(parse_json_object(res.text), fb)
            if made is None:
                stats["parse_failures"] += 1
            out.append(made or fb)
        return out

    if endpoint is not None:
        convs = [
            card_writer_messages(f"s{s}", [(i, pages[i].text) for i in ids], settings.writer_input_chars)
            for s, ids in enumerate(groups)
        ]
        results = await endpoint.chat(convs, [f"{key or ''}:card:{s}" for s in range(len(groups))])
        cards = _take(results, cards, lambda r, fb: _card_from_reply(r, fb, settings))
        # Regions are rebuilt from the (possibly model-written) cards before the region writer runs.
        regions = [lexical_region(k, ids, [cards[i] for i in ids], settings) for k, ids in enumerate(group_ids)]
        convs = [
            region_writer_messages(
                k,
                {f"s{i}": asdict(cards[i]) | {"documents": regions[k].submap[f"s{i}"]["documents"]} for i in ids},
                settings.writer_input_chars,
            )
            for k, ids in enumerate(group_ids)
        ]
        results = await endpoint.chat(convs, [f"{key or ''}:region:{k}" for k in range(len(group_ids))])
        regions = _take(results, regions, _region_from_reply)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    return DocumentIndex(
        key or index_key(context, doc_offsets, settings),
        settings.key_fields(),
        n_tokens,
        pages,
        groups,
        cards,
        regions,
        stats,
    )


class IndexCache:
    """Indexes by key: an in-memory LRU (GRPO resets several rollouts on one sample) over optional
    JSON files in ``cache_dir`` (``<key[:2]>/<key>.json``, written atomically)."""

    def __init__(self, cache_dir: str | Path | None = None, max_memory: int = 64) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.max_memory = max_memory
        self._memory: OrderedDict[str, DocumentIndex] = OrderedDict()
        self.hits = 0
        self.disk_hits = 0
        self.misses = 0

    def path(self, key: str) -> Path | None:
        return self.cache_dir / key[:2] / f"{key}.json" if self.cache_dir else None

    def has(self, key: str) -> bool:
        path = self.path(key)
        return key in self._memory or (path is not None and path.exists())

    def get(self, key: str, context: str) -> DocumentIndex | None:
        found = self._memory.get(key)
        if found is not None:
            self._memory.move_to_end(key)
            self.hits += 1
            return found
        path = self.path(key)
        if path is not None and path.exists():
            try:
                found = DocumentIndex.from_json(json.loads(path.read_text()), context)
            except (ValueError, KeyError, TypeError, DataError):
                found = None  # a corrupt or outdated file is rebuilt and overwritten, never trusted
            if found is not None:
                self.disk_hits += 1
                self._remember(key, found)
                return found
        self.misses += 1
        return None

    def put(self, index: DocumentIndex) -> None:
        self._remember(index.key, index)
        path = self.path(index.key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(index.to_json(), ensure_ascii=False))
            os.replace(tmp, path)  # a reader never sees half a file; an interrupted build leaves no entry

    def _remember(self, key: str, index: DocumentIndex) -> None:
        if self.max_memory <= 0:
            return
        self._memory[key] = index
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_memory:
            self._memory.popitem(last=False)


def build_indexes(
    dataset_folder: str | Path,
    cache_dir: str | Path,
    settings: IndexSettings | None = None,
    concurrency: int = 4,
    *,
    tokenizer=None,
    progress: bool = True,
    limit: int | None = None,
) -> dict[str, Any]:
    """Index every sample of a built dataset into ``cache_dir``; cached keys are skipped (resume).

    Args:
        dataset_folder: a folder written by ``coordrl data build`` (or one sweep subset).
        cache_dir: where the JSON indexes go.
        settings: partition and writer settings (default `IndexSettings()`).
        concurrency: documents in flight at once (default 4); model calls within a document are
            concurrent as well, bounded by the endpoint's own concurrency.
        tokenizer: tokenizer object (default: loaded from ``settings.tokenizer``).
        progress: show a tqdm bar (default True).
        limit: index only the first ``limit`` samples (default all).

    Returns:
        Counts: ``total``, ``built``, ``cached``, ``failed``, ``writer_calls``, ``parse_failures``,
        ``backend_errors``, ``first_error``, ``seconds``.
    """
    from tqdm.auto import tqdm

    settings = settings or IndexSettings()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer)
    ds = load_built(dataset_folder)
    n = len(ds) if limit is None else min(limit, len(ds))
    cache = IndexCache(cache_dir, max_memory=0)
    endpoint = make_chat_endpoint(
        settings.writer, settings.writer_model, settings.writer_api_key_env, max_tokens=settings.writer_max_tokens
    )
    stats: dict[str, Any] = {
        "total": n,
        "built": 0,
        "cached": 0,
        "failed": 0,
        "writer_calls": 0,
        "parse_failures": 0,
        "backend_errors": 0,
        "first_error": None,
    }
    t0 = time.perf_counter()

    async def run() -> None:
        semaphore = asyncio.Semaphore(max(1, concurrency))
        bar = tqdm(total=n, desc="index", unit="doc", disable=not progress)
        seen: set[str] = set()

        async def one(i: int) -> None:
            row = ds[i]
            key = index_key(row["context"], row.get("doc_offsets"), settings)
            if key in seen or cache.has(key):
                stats["cached"] += 1
                bar.update(1)
                return
            seen.add(key)
            async with semaphore:
                try:
                    index = await build_index(
                        row["context"], row.get("doc_offsets"), tokenizer, settings, endpoint, key
                    )
                    await asyncio.to_thread(cache.put, index)
                except Exception as exc:
                    stats["failed"] += 1
                    stats["first_error"] = (
                        stats["first_error"] or f"sample {row.get('id', i)!r}: {type(exc).__name__}: {exc}"
                    )
                else:
                    stats["built"] += 1
                    for k in ("writer_calls", "parse_failures", "backend_errors"):
                        stats[k] += index.stats.get(k, 0)
                    stats["first_error"] = stats["first_error"] or index.stats.get("first_error")
            bar.update(1)

        try:
            await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            bar.close()
            if endpoint is not None:
                await endpoint.aclose()

    shared_loop().run(run())
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    return stats


# -- command line ---------------------------------------------------------------------------------
