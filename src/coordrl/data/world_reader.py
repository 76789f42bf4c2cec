"""Reader examples for the synthetic world: (chunk, lead query) -> the fact sentence or ``Unknown``.

The world reader model (``coordrl/resources/world_reader/``, built by ``scripts/build_world_reader.py``)
is trained and measured on these. A world chunk holds whole documents (``"Document i:\\n<title>\\n<text>"``,
see `coordrl.data.world`); the lead queries are ``q_director(film)``, ``q_city(person)`` and
``q_decade(person)``. A query is answerable from a chunk exactly when the chunk holds the document with
that fact; the answer is then ``"<title>: <sentence>"``, the form the lexical reader gives (so a policy
trained with lexical readers sees the same kind of finding), e.g.
``"Nuvol: The film Nuvol was directed by Mefi and filmed in Girer."``; otherwise exactly ``Unknown``.

Negative kinds (all answer ``Unknown``):

* ``hard``: the entity is named in the chunk but the asked fact is not there (the director of a film in
  the chunk whose own document is elsewhere; the city of a person whose films are here);
* ``row``: an entity of the same question whose document is in another chunk;
* ``absent``: an entity of the right type that the question never mentions;
* ``wrong_type``: the query puts an entity of the chunk in the wrong slot ("Who directed the film
  <person>?", "In which city was <film> born?").

Pure text, no model code: the builder, the benchmark and the tests share these definitions.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from coordrl.data.world import World, q_city, q_decade, q_director

__all__ = [
    "META_NAME",
    "NEGATIVE_KINDS",
    "READER_UNKNOWN",
    "ReaderExample",
    "built_docs_per_chunk",
    "chunk_examples",
    "chunk_facts",
    "eval_examples",
    "grounded",
    "reply_value",
    "sample_chunk",
    "score_replies",
    "world_documents",
    "world_reader_dir",
]

READER_UNKNOWN = "Unknown"
META_NAME = "coordrl_world_reader.json"  # a world reader folder's recipe and figures
NEGATIVE_KINDS = ("hard", "row", "absent", "wrong_type")
QUERIES = {"director": q_director, "city": q_city, "decade": q_decade}

_DOC = re.compile(r"^Document \d+:\n([^\n]+)\n([^\n]*)", re.MULTILINE)
# The three fact sentences of the world's templates; the subject group names the entity asked about.
_FACTS = (
    ("director", re.compile(r"The film (?P<subject>\w+) was directed by (?P<value>\w+) and filmed in \w+\.")),
    ("city", re.compile(r"(?P<subject>\w+) was born in the city of (?P<value>\w+)\.")),
    ("decade", re.compile(r"In the decade of the (?P<value>\d+s) (?P<subject>\w+) was born\.")),
)


@dataclass(frozen=True)
class ReaderExample:
    """One reader prompt and its target.

    ``kind``: ``"positive"`` or one of :data:`NEGATIVE_KINDS`; ``answer``: the target reply;
    ``value``: the asked fact's value (director, city or decade) for positives, else ``""``.
    """

    chunk: str
    query: str
    answer: str
    kind: str
    value: str = ""


def chunk_facts(chunk: str) -> dict[tuple[str, str], tuple[str, str]]:
    """``{(relation, subject): (answer, value)}`` for every fact sentence in a world chunk.

    ``relation`` is ``director``, ``city`` or ``decade``; ``answer`` is ``"<title>: <sentence>"``.
    """
    facts: dict[tuple[str, str], tuple[str, str]] = {}
    for title, text in _DOC.findall(chunk):
        for relation, pattern in _FACTS:
            for m in pattern.finditer(text):
                if m.group("subject") == title:  # a film's director is not that document's subject
                    facts[(relation, title)] = (f"{title}: {m.group(0)}", m.group("value"))
    return facts


def world_documents(text: str) -> list[str]:
    """The whole world documents in ``text`` (``"Document i:\\n<title>\\n<sentences>"`` blocks, e.g.
    selected pages), each as a one-document reader chunk; a document cut by a page edge is left out."""
    return [m.group(0) for m in _DOC.finditer(text)]


def reply_value(reply: str, relation: str, subject: str) -> str | None:
    """The value a reader's reply states for ``relation`` (``director``, ``city``, ``decade``) of
    ``subject``, read from the world's fact sentence in it (``"F: The film F was directed by P and
    filmed in C."`` -> ``P``); None when the reply states no such fact (``Unknown``, another subject)."""
    pattern = dict(_FACTS)[relation]
    for m in pattern.finditer(reply):
        if m.group("subject") == subject:
            return m.group("value")
    return None


def grounded(reply: str, chunk: str) -> bool:
    """Whether a reader's reply is what the reader is built to reply, a fact sentence copied from its
    chunk: ``"<title>: <sentence>"`` with the chunk's own title and a sentence the chunk contains."""
    title, sep, sentence = reply.strip().partition(": ")
    return bool(sep and sentence) and sentence in chunk and any(t == title for t, _ in _DOC.findall(chunk))


def _entities(text: str, names: frozenset[str]) -> set[str]:
    return {w for w in re.findall(r"\w+", text) if w in names}


def chunk_examples(row: dict[str, Any], chunk_index: int, world: World) -> dict[str, list[ReaderExample]]:
    """Every positive and every ``hard``/``row``/``wrong_type`` negative of one chunk, by kind
    (``absent`` negatives are drawn by the callers: there are too many to list)."""
    chunk = row["chunks"][chunk_index]
    films, people = frozenset(world.films), frozenset(world.people)
    in_chunk = _entities(chunk, films | people)
    in_row = _entities("\n".join(row["chunks"]), films | people)
    facts = chunk_facts(chunk)
    out: dict[str, list[ReaderExample]] = {"positive": [], "hard": [], "row": [], "wrong_type": []}
    for (relation, subject), (answer, value) in sorted(facts.items()):
        out["positive"].append(ReaderExample(chunk, QUERIES[relation](subject), answer, "positive", value))
    for entity in sorted(in_row):
        relations = ("director",) if entity in films else ("city", "decade")
        for relation in relations:
            if (relation, entity) in facts:
                continue
            kind = "hard" if entity in in_chunk else "row"
            out[kind].append(ReaderExample(chunk, QUERIES[relation](entity), READER_UNKNOWN, kind))
    for entity in sorted(in_chunk):
        relations = ("city", "decade") if entity in films else ("director",)
        for relation in relations:
            out["wrong_type"].append(ReaderExample(chunk, QUERIES[relation](entity), READER_UNKNOWN, "wrong_type"))
    return out


def _absent(rng: random.Random, row: dict[str, Any], chunk: str, world: World) -> ReaderExample:
    mentioned = _entities("\n".join(row["chunks"]), frozenset(world.names))
    if rng.random() < 1 / 3:
        entity, relation = rng.choice([f for f in world.films if f not in mentioned]), "director"
    else:
        entity, relation = rng.choice([p for p in world.people if p not in mentioned]), rng.choice(("city", "decade"))
    return ReaderExample(chunk, QUERIES[relation](entity), READER_UNKNOWN, "absent")


def _is_contrast(chunk: str) -> bool:
    """Two facts of one relation in the chunk: a reply must tell two same-shaped sentences apart."""
    relations = [relation for relation, _ in chunk_facts(chunk)]
    return len(relations) != len(set(relations))


def sample_chunk(
    rng: random.Random,
    rows: list[dict[str, Any]],
    world: World,
    k: int,
    p_positive: float,
    negative_mix: dict[str, float],
    p_contrast: float = 0.0,
) -> list[ReaderExample]:
    """``k`` training examples about one random chunk of a random row (distinct queries where the
    chunk has enough): each a positive with probability ``p_positive`` (when the chunk has one),
    else a negative whose kind is drawn from ``negative_mix`` (weights per kind of
    :data:`NEGATIVE_KINDS`; a kind the chunk lacks falls back to ``absent``). Asking one passage
    several queries lets training share the passage's keys/values and contrasts answer and abstention.

    With probability ``p_contrast`` (default 0) the chunk is drawn among those holding two facts of
    one relation (two films, or two people), where a copied value most often comes from the wrong
    sentence; up to 50 draws, then the last one."""
    contrast = rng.random() < p_contrast
    for _ in range(50 if contrast else 1):
        row = rng.choice(rows)
        index = rng.randrange(len(row["chunks"]))
        chunk = row["chunks"][index]
        if not contrast or _is_contrast(chunk):
            break
    by_kind = chunk_examples(row, index, world)
    kinds = list(negative_mix)
    out: list[ReaderExample] = []
    for _ in range(k):
        if by_kind["positive"] and rng.random() < p_positive:
            pool = by_kind["positive"]
        else:
            pool = by_kind.get(rng.choices(kinds, weights=[negative_mix[x] for x in kinds])[0]) or []
        fresh = [e for e in pool if e not in out]
        out.append(rng.choice(fresh) if fresh else _absent(rng, row, chunk, world))
    return out


def eval_examples(
    rows: list[dict[str, Any]], world: World, seed: int = 0, row_negatives: int = 2
) -> list[ReaderExample]:
    """The held-out set: for every chunk of every row, all positives, all ``hard`` negatives, up to
    ``row_negatives`` (default 2) ``row`` negatives, one ``wrong_type`` and one ``absent`` negative
    (drawn with ``seed``). About 30 examples per world question, a third of them positives."""
    rng = random.Random(f"world-reader-eval-{seed}")
    out: list[ReaderExample] = []
    for row in rows:
        for index, chunk in enumerate(row["chunks"]):
            by_kind = chunk_examples(row, index, world)
            out += by_kind["positive"] + by_kind["hard"]
            out += rng.sample(by_kind["row"], min(row_negatives, len(by_kind["row"])))
            if by_kind["wrong_type"]:
                out.append(rng.choice(by_kind["wrong_type"]))
            out.append(_absent(rng, row, chunk, world))
    return out


def score_replies(examples: list[ReaderExample], replies: list[str]) -> dict[str, Any]:
    """Held-out figures of ``replies`` (one per example, stripped before comparison).

    * ``positive_exact``: share of positives whose reply equals the target ``"<title>: <sentence>"``;
      also over chunks with two facts of one relation (``positive_exact_contrast``) and the others
      (``positive_exact_single``), with their counts;
    * ``positive_names_value``: share of positives whose reply is not ``Unknown`` and contains the
      asked value (director, city or decade) as a whole word: the finding a lead agent needs;
    * ``negative_answered``: share of negatives whose reply is anything but exactly ``Unknown``;
      also per negative kind (``answered_<kind>``) and the counts.
    """
    if len(examples) != len(replies):
        raise ValueError(f"{len(replies)} replies for {len(examples)} examples")
    pos = [(e, r.strip()) for e, r in zip(examples, replies, strict=True) if e.kind == "positive"]
    neg = [(e, r.strip()) for e, r in zip(examples, replies, strict=True) if e.kind != "positive"]
    out: dict[str, Any] = {"n_positive": len(pos), "n_negative": len(neg)}
    if pos:
        out["positive_exact"] = sum(r == e.answer for e, r in pos) / len(pos)
        # Chunks holding two facts of the asked relation are where a reader must bind the value to
        # its subject; the others only need the relation.
        split: dict[str, list[tuple[ReaderExample, str]]] = {"contrast": [], "single": []}
        for e, r in pos:  # each chunk parsed once
            split["contrast" if _is_contrast(e.chunk) else "single"].append((e, r))
        for name, sel in split.items():
            if sel:
                out[f"positive_exact_{name}"] = sum(r == e.answer for e, r in sel) / len(sel)
                out[f"n_positive_{name}"] = len(sel)
        out["positive_names_value"] = sum(
            r != READER_UNKNOWN and re.search(rf"\b{re.escape(e.value)}\b", r) is not None for e, r in pos
        ) / len(pos)
    if neg:
        out["negative_answered"] = sum(r != READER_UNKNOWN for _, r in neg) / len(neg)
        for kind in NEGATIVE_KINDS:
            sel = [r for e, r in neg if e.kind == kind]
            if sel:
                out[f"answered_{kind}"] = sum(r != READER_UNKNOWN for r in sel) / len(sel)
                out[f"n_{kind}"] = len(sel)
    return out


def world_reader_dir() -> Path:
    """The kept world reader model folder inside the package (``coordrl/resources/world_reader``)."""
    return Path(str(resources.files("coordrl").joinpath("resources", "world_reader")))


def built_docs_per_chunk(model_dir: str | Path) -> int | None:
    """The whole world documents per chunk a world reader model was built to read (its
    ``coordrl_world_reader.json`` recipe), or None where ``model_dir`` is not a world reader folder
    (a hub name, any other model). Readers built before the recipe named it read two."""
    meta = Path(model_dir) / META_NAME
    try:
        recipe = json.loads(meta.read_text())["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(recipe.get("docs_per_chunk", 2))
