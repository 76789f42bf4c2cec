"""The synthetic world laid out for HMARS: the same questions, longer documents, evidence split across sub-agents.

A sibling of `coordrl.data.world` (the PARSER world), built from it: the same entities, sentence
templates, questions, filler documents and held-out split (`world_rows` with the same prefixes, so the
held-out chains are the PARSER world's and never occur in training). What changes is the document:

* each question's document is padded with filler documents to `N_DOCS` documents (400-700 tokens
  by tokenizer), which HMARS indexes (`coordrl index`, lexical writer) into pages of ``page_tokens``
  tokens and sub-agents of ``c_sub`` tokens (`HMARS_WORLD_ENV`: 64-token pages, two per sub-agent, so
  4-6 sub-agents under one mid-agent);
* the documents are re-ordered (a seeded shuffle, redrawn until it fits) so that the two documents a
  question needs lie whole on one page each, owned by two *different* sub-agents, and so that no
  sub-agent holds more than `MAX_TITLES` documents (the lexical regional memory lists six entities per
  sub-agent, titles first, so every document title is visible to the mid-agent).

The needed documents (`needed_titles`): bridge "In which city was the director of the film F born?"
needs F's document ("The film F was directed by P ...") and P's ("P was born in the city of C ...");
comparison "Who was born earlier, P1 or P2?" needs P1's and P2's (their birth decades). With the
lexical selector at `HMARS_WORLD_ENV`'s threshold, the question alone selects neither: a page is
selected when one query sentence (of the question, interpretation or hint: `lexical_query_sentences`)
is mostly covered by one of its sentences, and the question's words are spread over two documents
(bridge) or name a second person (comparison). A question in the page's own words that names its
entity (the world's lead-agent queries, `q_director`, `q_city`, `q_decade`) selects it. So the
broadcast must ask one question per needed document, and the bridge's second question must name the
entity the question does not (the director). With each query part scored whole (the setting off)
routing matters too: two questions in one interpretation dilute each other, and only a hint on the
sub-agent that holds its name selects the page.

Page boundaries depend on the tokenizer the environment cuts pages with (the policy's in training, the
shipped one otherwise): lay rows out with that tokenizer (``tokenizer=``).

Pure data: no environment code. `answer_from_evidence` is a model-free reader of the world's three
fact sentences (the rule answer role of the scripted-broadcast benchmark); `coordrl.envs.hmars_world`
runs the episodes.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordrl.data.chunk import chunk_context
from coordrl.data.errors import DataError
from coordrl.data.layout import DOC_SEPARATOR, Paragraph, document_header, render_context
from coordrl.data.tokens import load_tokenizer
from coordrl.data.world import (
    bridge_question,
    comparison_question,
    make_world,
    q_city,
    q_decade,
    q_director,
    world_rows,
)
from coordrl.data.world_reader import READER_UNKNOWN, chunk_facts

__all__ = [
    "HMARS_WORLD_ENV",
    "HMARS_WORLD_SYSTEM_PROMPT",
    "MAX_TITLES",
    "N_DOCS",
    "answer_from_evidence",
    "build_hmars_world_dataset",
    "document_number",
    "earlier_born",
    "hmars_world_rows",
    "hmars_world_splits",
    "lay_out",
    "needed_queries",
    "needed_titles",
    "paragraphs",
    "parse_question",
]

# Environment settings the world is laid out for (`HmarsEnvConfig` fields): 64-token pages, two per
# sub-agent, one page selected per sub-agent. Threshold 0.5, not the env's default 0.4: on pages this
# small the query words "decade" and "born" are rare enough that a decade query naming the wrong
# person still reaches 0.4 on another person's page; at 0.5 the name must match. Card summaries in the
# mid-agent's memory: the regional memory names the bridge question's director but only the film's card
# summary ("F: The film F was directed by P ...") says he directed F, so without them a policy reading
# its observation can only guess the second hop. Each query sentence scored alone: the broadcast is
# judged on the questions it asks (the bridge entity above all), not on routing each to its sub-agent,
# a lookup a four-layer policy did not learn in 680 SFT steps (docs/hmars_world.md). The question again
# after the memory: the policy copies both compared names from right before its broadcast, not from the
# question ~700 tokens back, where it kept repeating one of them.
HMARS_WORLD_ENV: dict[str, Any] = {
    "c_sub": 128,
    "page_tokens": 64,
    "group_size": 10,
    "pages_per_subagent": 1,
    "lexical_select_threshold": 0.5,
    "memory_map": False,
    "memory_card_summaries": True,
    "lexical_query_sentences": True,
    "question_after_memory": True,
}
# The mid-agent's system prompt on this world (`configs/hmars_world_cpu.yaml`, the HMARS warm start):
# short, because the tiny world policy reads it at every step and the protocol's own prompt is written
# for general documents.
HMARS_WORLD_SYSTEM_PROMPT = (
    "You direct sub-agents (s0, s1, ...) that read a document you cannot see; after the question comes "
    "their memory. Call broadcast once. interpretation: the questions that answer it, naming the bridge "
    "entity. hints: each question for the sub-agent that holds its name. Then reply with the answer "
    "inside <answer></answer>."
)
N_DOCS = 16  # documents per question: its own 7 and 9 filler documents
MAX_TITLES = 6  # documents per sub-agent at most: the lexical regional memory shows six entities per sub-agent
LAYOUT_TRIES = 2000

_HEADER = re.compile(r"^Document \d+:\n")


def _template(text: str, *slots: str) -> re.Pattern[str]:
    """A regex of a question template whose slots were filled with ``slots``."""
    pattern = re.escape(text)
    for slot in slots:
        pattern = pattern.replace(re.escape(slot), r"(\w+)", 1)
    return re.compile(f"^{pattern}$")


_BRIDGE = _template(bridge_question("FILMSLOT"), "FILMSLOT")
_COMPARISON = _template(comparison_question("FIRSTSLOT", "SECONDSLOT"), "FIRSTSLOT", "SECONDSLOT")


# -- rows -----------------------------------------------------------------------------------------


def paragraphs(row: dict[str, Any]) -> list[Paragraph]:
    """The row's documents, in order, as `Paragraph`s (title, body)."""
    context = row["context"]
    bounds = list(row["doc_offsets"]) + [len(context) + len(DOC_SEPARATOR)]
    out = []
    for a, b in itertools.pairwise(bounds):
        title, _, body = _HEADER.sub("", context[a : b - len(DOC_SEPARATOR)], count=1).partition("\n")
        out.append(Paragraph(title, body))
    return out


def needed_titles(row: dict[str, Any]) -> list[str]:
    """Titles of the two documents the question needs: bridge ``[film, director]``, comparison ``[p1, p2]``."""
    chain = json.loads(row["chain"])
    return [chain["film"], chain["director"]] if row["type"] == "bridge" else list(chain["people"])


def needed_queries(row: dict[str, Any]) -> list[str]:
    """The world's lead-agent query for each needed document, in `needed_titles` order: bridge
    ``[q_director(film), q_city(director)]``, comparison ``[q_decade(p1), q_decade(p2)]``."""
    titles = needed_titles(row)
    if row["type"] == "bridge":
        return [q_director(titles[0]), q_city(titles[1])]
    return [q_decade(t) for t in titles]


def document_number(row: dict[str, Any], title: str) -> int:
    """1-based number of the document titled ``title``."""
    titles = [p.title for p in paragraphs(row)]
    if title not in titles:
        raise DataError(f"sample {row.get('id', '?')!r} has no document titled {title!r}")
    return titles.index(title) + 1


# -- layout ---------------------------------------------------------------------------------------


def _doc_tokens(paras: Sequence[Paragraph], tokenizer) -> tuple[list[int], list[int]]:
    """Tokens of each Document header (by number) and of each paragraph with its separator: the
    layout search adds them up instead of tokenizing every candidate order."""
    headers = [document_header(i) for i in range(1, len(paras) + 1)]
    bodies = [p.text + DOC_SEPARATOR for p in paras]
    ids = tokenizer(headers + bodies, add_special_tokens=False)["input_ids"]
    return [len(x) for x in ids[: len(paras)]], [len(x) for x in ids[len(paras) :]]


def _check(spans: Sequence[tuple[int, int]], needed: Sequence[int], settings: dict[str, Any]) -> tuple[bool, int]:
    """The layout rules on Document spans in pages (``(first page, last page)`` per Document, in order;
    a Document owns its trailing separator, as `chunk_context`'s Document lists count it); returns
    ``(ok, number of sub-agents)``."""
    per = settings["c_sub"] // settings["page_tokens"]
    n_sub = spans[-1][1] // per + 1
    if any(spans[d - 1][0] != spans[d - 1][1] for d in needed):
        return False, n_sub
    if len({spans[d - 1][0] // per for d in needed}) != len(needed):
        return False, n_sub
    titles = [0] * n_sub
    for first, _ in spans:  # a Document's header lies in its first page
        titles[first // per] += 1
    return max(titles) <= MAX_TITLES, n_sub


def _exact_spans(context: str, offsets: list[int], tokenizer, page_tokens: int) -> list[tuple[int, int]]:
    spans: dict[int, list[int]] = {}
    for page in chunk_context(context, tokenizer, page_tokens, offsets):
        for d in page.documents:
            spans.setdefault(d, []).append(page.index)
    return [(min(spans[d]), max(spans[d])) for d in range(1, len(offsets) + 1)]


def lay_out(row: dict[str, Any], tokenizer, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """``row`` (a `coordrl.data.world` row) re-ordered for HMARS (see the module docstring).

    The first order tried is the row's own; then seeded shuffles (seeded by the question) until the
    layout rules hold, checked on token counts added up per Document and confirmed on the rendered
    text with `chunk_context` (the environment's own page cutter). Returns a new row without the
    PARSER reader chunks (``chunks``, ``chunk_documents``), with ``context``, ``doc_offsets`` and
    ``gold_documents`` recomputed.

    Raises DataError when no order fits in `LAYOUT_TRIES` shuffles or the document needs more than
    one mid-agent region (``group_size`` sub-agents).
    """
    settings = {**HMARS_WORLD_ENV, **(settings or {})}
    paras = paragraphs(row)
    titles = [p.title for p in paras]
    need = [titles.index(t) for t in needed_titles(row)]
    header_tokens, body_tokens = _doc_tokens(paras, tokenizer)
    page = settings["page_tokens"]
    rng = random.Random(f"hmars-world-layout-{row['question']}")
    order = list(range(len(paras)))
    for _ in range(LAYOUT_TRIES):
        needed = [order.index(i) + 1 for i in need]
        spans, pos = [], 0
        for k, i in enumerate(order):
            end = pos + header_tokens[k] + body_tokens[i]
            spans.append((pos // page, (end - 1) // page))
            pos = end
        ok, n_sub = _check(spans, needed, settings)
        if ok:  # the sums are exact when the tokenizer splits at Document boundaries; confirm on the text
            context, offsets = render_context([paras[i] for i in order])
            ok, n_sub = _check(_exact_spans(context, offsets, tokenizer, page), needed, settings)
            if ok:
                out = {k: v for k, v in row.items() if k not in ("chunks", "chunk_documents")}
                out.update(context=context, doc_offsets=offsets, gold_documents=sorted(needed))
                return out
        if n_sub > settings["group_size"]:
            raise DataError(
                f"sample {row.get('id', '?')!r}: {n_sub} sub-agents exceed one region of {settings['group_size']}"
            )
        rng.shuffle(order)
    raise DataError(f"sample {row.get('id', '?')!r}: no document order fits the HMARS layout rules")


def _tokenizer(tokenizer):
    if tokenizer is None or isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    return tokenizer


def hmars_world_rows(
    n: int,
    seed: int,
    *,
    tokenizer=None,
    exclude: set[tuple] | None = None,
    prefix: str = "world",
    n_docs: int = N_DOCS,
    settings: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], set[tuple]]:
    """`coordrl.data.world.world_rows` padded to ``n_docs`` documents and laid out by `lay_out`.

    ``tokenizer``: the tokenizer pages are cut with (an object, a spec for `load_tokenizer`, or None:
    the shipped one).
    """
    tok = _tokenizer(tokenizer)
    rows, keys = world_rows(n, seed, make_world(seed), exclude=exclude, prefix=prefix, n_docs=n_docs)
    return [lay_out(r, tok, settings) for r in rows], keys


def hmars_world_splits(
    n_train: int,
    n_heldout: int,
    seed: int = 0,
    *,
    tokenizer=None,
    n_docs: int = N_DOCS,
    settings: dict[str, Any] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "heldout": rows}`` as `coordrl.data.world.world_splits` draws them (the same
    questions; held-out chains never occur in training), laid out for HMARS."""
    tok = _tokenizer(tokenizer)
    kw = {"tokenizer": tok, "n_docs": n_docs, "settings": settings}
    heldout, held_keys = hmars_world_rows(n_heldout, seed, prefix="heldout", **kw)
    train, _ = hmars_world_rows(n_train, seed, exclude=held_keys, prefix="train", **kw)
    return {"train": train, "heldout": heldout}


def build_hmars_world_dataset(
    out: str | Path, n_train: int = 4000, n_heldout: int = 200, seed: int = 0, *, tokenizer=None
) -> dict[str, Path]:
    """Write ``<out>/train`` and ``<out>/heldout`` (datasets ``save_to_disk`` folders); returns them.
    ``tokenizer`` must be the one the environment cuts pages with (see the module docstring)."""
    import datasets

    out = Path(out)
    paths = {}
    for split, rows in hmars_world_splits(n_train, n_heldout, seed, tokenizer=tokenizer).items():
        folder = out / split
        datasets.Dataset.from_list(rows).save_to_disk(str(folder))
        paths[split] = folder
    meta = {"n_train": n_train, "n_heldout": n_heldout, "seed": seed, "n_docs": N_DOCS, "hmars": HMARS_WORLD_ENV}
    (out / "hmars_world.json").write_text(json.dumps(meta) + "\n")
    return paths


# -- the rule answer role -------------------------------------------------------------------------


def parse_question(question: str) -> tuple[str, list[str]] | None:
    """``("bridge", [film])`` or ``("comparison", [p1, p2])`` for a world question; None otherwise."""
    if match := _BRIDGE.match(question.strip()):
        return "bridge", [match.group(1)]
    if match := _COMPARISON.match(question.strip()):
        return "comparison", list(match.groups())
    return None


def answer_from_evidence(question: str, evidence: str) -> str:
    """The answer a perfect reader of ``evidence`` gives, or exactly ``Unknown`` when the evidence lacks a fact.

    Model-free: reads the world's fact sentences (`coordrl.data.world_reader.chunk_facts`) of the
    whole documents in ``evidence`` (``"Document i:\\n<title>\\n<text>"`` blocks, e.g. selected pages)
    and follows the question's chain: bridge, the film's director, then that director's birth city;
    comparison, both birth decades, then the earlier-born name. Nothing is guessed, so its exact match
    measures whether the selected pages hold the evidence.
    """
    facts = {key: value for key, (_, value) in chunk_facts(evidence).items()}
    parsed = parse_question(question)
    if parsed is None:
        return READER_UNKNOWN
    kind, names = parsed
    if kind == "bridge":
        director = facts.get(("director", names[0]))
        city = facts.get(("city", director)) if director else None
        return city or READER_UNKNOWN
    return earlier_born(names, facts.get(("decade", names[0])), facts.get(("decade", names[1])))


def earlier_born(names: Sequence[str], first: str | None, second: str | None) -> str:
    """A comparison's answer: of the two ``names``, the one born in the earlier decade (``first``,
    ``second``: their decades, e.g. ``"1930s"``); ``Unknown`` when a decade is missing or they tie."""
    if first and second and first != second:
        return names[0] if int(first.rstrip("s")) < int(second.rstrip("s")) else names[1]
    return READER_UNKNOWN
