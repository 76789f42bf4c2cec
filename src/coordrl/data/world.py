"""A seeded synthetic multi-hop world for the CPU learning check.

Entities (people, films, cities, organisations) get syllable-generated one-word names; relations are
short factual sentences. Every question draws its own chain of entities, so a policy must copy names
from the question and from the readers' findings instead of memorising facts:

* ``bridge``: "In which city was the director of the film F born?" -> the film's document says
  "The film F was directed by P and filmed in C2." (C2 is a decoy one hop away), P's document says
  "P was born in the city of C." -> answer C.
* ``comparison``: "Who was born earlier, P1 or P2?" -> "In the decade of the 1930s P1 was born." for
  both (two parallel lookups, best asked in one ``query_agents`` call) -> the earlier-born name. Birth
  decades, one token each, rather than four-digit years: a tiny model does not learn to compare digit
  strings in minutes (measured: chance after 350 SFT steps and 71 GRPO steps), while ordering ten tokens
  is within its reach.

Each question's context holds the documents it needs plus distractor documents (other films,
people and organisations, some sharing the question's entities), shuffled, in the
``"Document i:\\n<title>\\n<text>"`` layout of `coordrl.data.layout.render_context`; rows also
carry ``chunks`` (two whole documents per reader, so no fact is cut by a chunk boundary), which the
PARSER env uses instead of token chunking. Held-out questions are drawn first and their chains (bridge: film,
director, city; comparison: the unordered pair) are excluded from training.

`build_world_dataset` writes ``train/`` and ``heldout/`` dataset folders that `coordrl train`
(``train_data: <folder>/train``) and evaluation load directly. `build_world_tokenizer` builds the
matching tokenizer: byte-level BPE (exact round trip of any text, so tool-call JSON survives),
GPT-2-style split where every word keeps its leading space (so every entity name is one
leading-space token, identical in question, query and finding), the Qwen3 special tokens and TRL's
Qwen3 chat template.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordrl.data.layout import Paragraph, render_context

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "n", "r", "l"]

N_PEOPLE = 160
N_FILMS = 120
N_CITIES = 48
N_ORGS = 24
QUESTION_TYPES = ("bridge", "comparison")
DECADES = tuple(range(1900, 2000, 10))
DOCS_PER_CHUNK = 2


@dataclass(frozen=True)
class World:
    people: tuple[str, ...]
    films: tuple[str, ...]
    cities: tuple[str, ...]
    orgs: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return self.people + self.films + self.cities + self.orgs


def make_world(seed: int = 0) -> World:
    """Name pools (disjoint, sorted within each pool), deterministic for ``seed``."""
    rng = random.Random(f"world-names-{seed}")
    syllables = [o + v for o in ONSETS for v in VOWELS]
    seen: set[str] = set()
    names: list[str] = []
    total = N_PEOPLE + N_FILMS + N_CITIES + N_ORGS
    while len(names) < total:
        name = (rng.choice(syllables) + rng.choice(syllables) + rng.choice(CODAS)).capitalize()
        # "s" endings are stemmed by the lexical reader; keep names clean of that and of stopwords.
        if name in seen or name.endswith("s") or len(name) < 4:
            continue
        seen.add(name)
        names.append(name)
    a, b, c = N_PEOPLE, N_PEOPLE + N_FILMS, N_PEOPLE + N_FILMS + N_CITIES
    return World(tuple(names[:a]), tuple(names[a:b]), tuple(names[b:c]), tuple(names[c:]))


@functools.lru_cache(maxsize=4)  # immutable, and asked for once per padded question
def filler_world(seed: int = 0, n_people: int = 480, n_films: int = 480, n_orgs: int = 96) -> World:
    """Entities for padding documents to any length: names from the same syllables as `make_world`'s,
    disjoint from them, so a filler document never mentions a question's entities (cities are shared:
    they are places, never asked about by name)."""
    rng = random.Random(f"world-filler-names-{seed}")
    syllables = [o + v for o in ONSETS for v in VOWELS]
    taken = set(make_world(seed).names)
    names: list[str] = []
    while len(names) < n_people + n_films + n_orgs:
        name = (rng.choice(syllables) + rng.choice(syllables) + rng.choice(CODAS)).capitalize()
        if name in taken or name.endswith("s") or len(name) < 4:
            continue
        taken.add(name)
        names.append(name)
    a, b = n_people, n_people + n_films
    return World(tuple(names[:a]), tuple(names[a:b]), make_world(seed).cities, tuple(names[b:]))


def filler_docs(rng: random.Random, filler: World, n: int) -> list[Paragraph]:
    """``n`` distinct filler documents (people, films, organisations in the world's proportions)."""
    kinds = ["person"] * 4 + ["film"] * 3 + ["org"]
    pools = {"person": list(filler.people), "film": list(filler.films), "org": list(filler.orgs)}
    for pool in pools.values():
        rng.shuffle(pool)
    if n > sum(map(len, pools.values())):
        raise ValueError(f"{n} filler documents asked, the filler world has {sum(map(len, pools.values()))}")
    docs: list[Paragraph] = []
    while len(docs) < n:
        kind = rng.choice([k for k in kinds if pools[k]])
        name = pools[kind].pop()
        if kind == "person":
            docs.append(person_doc(name, rng.choice(filler.cities), rng.choice(DECADES), rng.choice(filler.orgs)))
        elif kind == "film":
            docs.append(film_doc(name, rng.choice(filler.people), rng.choice(filler.cities)))
        else:
            docs.append(org_doc(name, rng.choice(filler.cities)))
    return docs


def decade_text(decade: int) -> str:
    return f"{decade}s"


def decade_sentence(person: str, decade: int) -> str:
    # The decade token sits right before the name it belongs to: "which name goes with the earliest
    # decade" is then one attention step from the decade, not a search back through the sentence.
    return f"In the decade of the {decade_text(decade)} {person} was born."


# -- sentences (the lexical reader answers "<title>: <sentence>") -----------------------------------


def film_doc(film: str, director: str, city: str) -> Paragraph:
    return Paragraph(film, f"The film {film} was directed by {director} and filmed in {city}.")


def person_doc(person: str, city: str, decade: int, org: str) -> Paragraph:
    return Paragraph(
        person, f"{person} was born in the city of {city}. {decade_sentence(person, decade)} {person} worked for {org}."
    )


def org_doc(org: str, city: str) -> Paragraph:
    return Paragraph(org, f"{org} is an organisation based in {city}.")


def bridge_question(film: str) -> str:
    return f"In which city was the director of the film {film} born?"


def comparison_question(p1: str, p2: str) -> str:
    return f"Who was born earlier, {p1} or {p2}?"


# Queries a competent lead agent asks (the scripted demonstrations use exactly these).
def q_director(film: str) -> str:
    return f"Who directed the film {film}?"


def q_city(person: str) -> str:
    return f"In which city was {person} born?"


def q_decade(person: str) -> str:
    return f"In which decade was {person} born?"


# -- questions ------------------------------------------------------------------------------------


def _person_facts(rng: random.Random, world: World, person: str, used_decades: set[int]) -> tuple[str, int, str]:
    # Birth decades are distinct among the people of one question (so a comparison always has an answer).
    decade = rng.choice([d for d in DECADES if d not in used_decades])
    used_decades.add(decade)
    return rng.choice(world.cities), decade, rng.choice(world.orgs)


def _distractors(
    rng: random.Random, world: World, avoid: set[str], used_decades: set[int], n_people: int, n_films: int, n_orgs: int
) -> list[Paragraph]:
    docs: list[Paragraph] = []
    people = [p for p in world.people if p not in avoid]
    films = [f for f in world.films if f not in avoid]
    for p in rng.sample(people, n_people):
        docs.append(person_doc(p, *_person_facts(rng, world, p, used_decades)))
        avoid.add(p)
    for f in rng.sample(films, n_films):
        docs.append(film_doc(f, rng.choice([p for p in world.people if p not in avoid]), rng.choice(world.cities)))
    for o in rng.sample(world.orgs, n_orgs):
        docs.append(org_doc(o, rng.choice(world.cities)))
    return docs


def make_question(
    rng: random.Random, world: World, qtype: str, n_docs: int | None = None, docs_per_chunk: int = DOCS_PER_CHUNK
) -> tuple[dict[str, Any], tuple]:
    """One question with its own chain and document; returns ``(row_without_id, chain_key)``.

    ``n_docs``: pad the document with `filler_docs` to this many documents (default: the question's
    own 7). The question, its chain and ``rng``'s state afterwards are the same at every length, so a
    length sweep asks the same questions of longer and longer documents. ``docs_per_chunk``: whole
    documents per reader chunk (default 2); only the ``chunks`` / ``chunk_documents`` columns
    depend on it. With 1, no chunk holds two facts of one relation, so a reader never has to tell
    two same-shaped sentences apart (what a 4-layer world reader does not learn; the kept one is built
    for one document per chunk).
    """
    used_decades: set[int] = set()
    if qtype == "bridge":
        film = rng.choice(world.films)
        director = rng.choice(world.people)
        city, decade, org = _person_facts(rng, world, director, used_decades)
        decoy = rng.choice([c for c in world.cities if c != city])
        gold = [film_doc(film, director, decoy), person_doc(director, city, decade, org)]
        # Distractors one hop away: another film by the same director (other city), a person born in the decoy city.
        other_film = rng.choice([f for f in world.films if f != film])
        near = [film_doc(other_film, director, rng.choice([c for c in world.cities if c != city]))]
        avoid = {film, director, other_film}
        distract = _distractors(rng, world, avoid, used_decades, 2, 1, 1)
        question, answers, key = bridge_question(film), [city], ("bridge", film, director, city)
        extra = {"film": film, "director": director, "decoy": decoy}
    elif qtype == "comparison":
        p1, p2 = rng.sample(world.people, 2)
        f1 = _person_facts(rng, world, p1, used_decades)
        f2 = _person_facts(rng, world, p2, used_decades)
        gold = [person_doc(p1, *f1), person_doc(p2, *f2)]
        other_film = rng.choice(world.films)
        near = [film_doc(other_film, p1, f2[0])]
        avoid = {p1, p2, other_film}
        distract = _distractors(rng, world, avoid, used_decades, 2, 1, 1)
        earlier = p1 if f1[1] < f2[1] else p2
        question, answers, key = comparison_question(p1, p2), [earlier], ("comparison", *sorted((p1, p2)))
        extra = {"people": [p1, p2], "decades": [f1[1], f2[1]], "decoy": p2 if earlier == p1 else p1}
    else:
        raise ValueError(f"unknown question type {qtype!r}; use one of {QUESTION_TYPES}")
    docs = gold + near + distract
    order = list(range(len(docs)))
    rng.shuffle(order)
    if n_docs is not None and n_docs > len(docs):
        frng = random.Random(f"world-filler-{key}-{n_docs}")  # its own stream: ``rng`` is left as at any length
        docs += filler_docs(frng, filler_world(), n_docs - len(docs))
        order = list(range(len(docs)))
        frng.shuffle(order)
    paragraphs = [docs[i] for i in order]
    gold_documents = sorted(order.index(i) + 1 for i in range(len(gold)))
    context, offsets = render_context(paragraphs)
    # Readers get whole documents (docs_per_chunk per reader), so no fact is ever cut in half.
    bounds = offsets[::docs_per_chunk] + [len(context)]
    chunks = [context[a:b].rstrip("\n") for a, b in itertools.pairwise(bounds)]
    chunk_documents = [
        list(range(i * docs_per_chunk + 1, min((i + 1) * docs_per_chunk, len(paragraphs)) + 1))
        for i in range(len(chunks))
    ]
    row = {
        "question": question,
        "answers": answers,
        "context": context,
        "doc_offsets": offsets,
        "gold_documents": gold_documents,
        "chunks": chunks,
        "chunk_documents": chunk_documents,
        "type": qtype,
        "chain": json.dumps(extra),
    }
    return row, key


def world_rows(
    n: int,
    seed: int,
    world: World,
    exclude: set[tuple] | None = None,
    prefix: str = "world",
    n_docs: int | Sequence[int] | None = None,
    docs_per_chunk: int = DOCS_PER_CHUNK,
) -> tuple[list[dict[str, Any]], set[tuple]]:
    """``n`` questions, types alternating, chains unique and outside ``exclude``; ``n_docs`` pads each
    document to that many documents (the same questions at every length), or, given several lengths,
    to one of them drawn per question (seeded); ``docs_per_chunk`` sets the reader chunks (see
    `make_question`)."""
    rng = random.Random(f"world-questions-{seed}-{prefix}")
    # Its own stream, so the questions are the same whichever lengths pad them.
    lengths = random.Random(f"world-lengths-{seed}-{prefix}")
    exclude = set(exclude or ())
    keys: set[tuple] = set()
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        qtype = QUESTION_TYPES[len(rows) % len(QUESTION_TYPES)]
        length = lengths.choice(n_docs) if isinstance(n_docs, Sequence) else n_docs
        row, key = make_question(rng, world, qtype, length, docs_per_chunk)
        if key in exclude or key in keys:
            continue
        keys.add(key)
        rows.append({"id": f"{prefix}-{len(rows):05d}", **row})
    return rows, keys


def world_splits(
    n_train: int,
    n_heldout: int,
    seed: int = 0,
    docs_per_chunk: int = DOCS_PER_CHUNK,
    train_docs: Sequence[int] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "heldout": rows}``; held-out chains never occur in training. The questions do
    not depend on ``docs_per_chunk`` (documents per reader chunk, default 2) or on ``train_docs``
    (documents per training question, one of these lengths drawn per question; None: each question's
    own 7). Held-out documents are never padded: a length sweep pads them itself."""
    world = make_world(seed)
    heldout, held_keys = world_rows(n_heldout, seed, world, prefix="heldout", docs_per_chunk=docs_per_chunk)
    train, _ = world_rows(
        n_train, seed, world, exclude=held_keys, prefix="train", n_docs=train_docs, docs_per_chunk=docs_per_chunk
    )
    return {"train": train, "heldout": heldout}


def build_world_dataset(
    out: str | Path,
    n_train: int = 4000,
    n_heldout: int = 200,
    seed: int = 0,
    docs_per_chunk: int = DOCS_PER_CHUNK,
    train_docs: Sequence[int] | None = None,
) -> dict[str, Path]:
    """Write ``<out>/train`` and ``<out>/heldout`` (datasets ``save_to_disk`` folders); returns them.
    ``docs_per_chunk`` and ``train_docs`` as in `world_splits`."""
    import datasets

    if docs_per_chunk < 1:
        raise ValueError(f"docs_per_chunk must be >= 1, got {docs_per_chunk}")
    if train_docs is not None and (not train_docs or any(not isinstance(n, int) or n < 1 for n in train_docs)):
        raise ValueError(f"train_docs must be a non-empty list of document counts >= 1, got {train_docs!r}")
    out = Path(out)
    paths = {}
    for split, rows in world_splits(n_train, n_heldout, seed, docs_per_chunk, train_docs).items():
        folder = out / split
        datasets.Dataset.from_list(rows).save_to_disk(str(folder))
        paths[split] = folder
    meta = {"n_train": n_train, "n_heldout": n_heldout, "seed": seed}
    if docs_per_chunk != DOCS_PER_CHUNK:  # the default's record stays as it was
        meta["docs_per_chunk"] = docs_per_chunk
    if train_docs is not None:
        meta["train_docs"] = list(train_docs)
    (out / "world.json").write_text(json.dumps(meta) + "\n")
    return paths


# -- tokenizer ------------------------------------------------------------------------------------

# GPT-2-style split: every word keeps its own leading space (and nothing else); a number (with a
# plural s, as in 1930s) stays whole.
WORLD_SPLIT_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+s?| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


# -- scripted demonstrations and batched evaluation (warm start, learning check) ------------------

# The world's lead-agent system prompt (configs/world_cpu.yaml sets the same text). The protocol of
# LEAD_SYSTEM_PROMPT in a quarter of the tokens: a tiny policy's steps cost about linearly in prompt length.
WORLD_SYSTEM_PROMPT = (
    "You lead readers of a document you cannot see. Ask them with query_agents: focused questions that name "
    "who or what they are about; independent questions go in one call. Use their findings to ask the next "
    "question. Reply with the answer inside <answer></answer>."
)

# Environment settings the world runs with (configs/world_cpu.yaml uses the same values).
WORLD_ENV = {
    "readers": "lexical",
    "lexical_threshold": 0.9,
    "chunk_tokens": 48,
    "max_turns": 3,
    "observation_max_tokens": 256,
}


def tool_call_text(queries: list[str]) -> str:
    return "<tool_call>\n" + json.dumps({"name": "query_agents", "arguments": {"queries": queries}}) + "\n</tool_call>"


def answer_text(answer: str) -> str:
    # A leading space keeps the answer the same token as the name in question and findings.
    return f"<answer> {answer}</answer>"


def scripted_turns(row: dict[str, Any], good: bool) -> list[str]:
    """Assistant turns of a demonstration: ``good`` solves the question; otherwise it stops after the
    first hop and answers a decoy (bridge: the filming city; comparison: a birth decade)."""
    chain = json.loads(row["chain"])
    if row["type"] == "bridge":
        first = tool_call_text([q_director(chain["film"])])
        if good:
            return [first, tool_call_text([q_city(chain["director"])]), answer_text(row["answers"][0])]
        return [first, answer_text(chain["decoy"])]
    p1, p2 = chain["people"]
    if good:
        return [tool_call_text([q_decade(p1), q_decade(p2)]), answer_text(row["answers"][0])]
    return [tool_call_text([q_decade(p1)]), answer_text(decade_text(chain["decades"][0]))]
