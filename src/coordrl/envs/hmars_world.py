"""HMARS episodes on the HMARS world (`coordrl.data.hmars_world`): scripted broadcasts and the rule answer role.

A scripted broadcast is ``(interpretation, hints)`` for `MidAgentEnv.broadcast`, the tool a trained
mid-agent calls. Kinds (`SCRIPTED`), for a question whose needed documents are ``[film, director]``
(bridge) or ``[p1, p2]`` (comparison) and their world queries (`needed_queries`):

* ``question``: the question as the interpretation, no hints (every sub-agent gets the question);
* ``good``: both queries as the interpretation, each query as the hint of the sub-agent holding its
  document (the bridge's second query names the director, whom the question does not name);
* ``first_hop``: only the first query, routed (bridge: the film's page only; comparison: one person);
* ``interpretation_only``: the good interpretation, no hints (in mode ``full`` every sub-agent then
  gets it, which is also what sending both queries as every sub-agent's hint does);
* ``second_hop``: only the second query, no hints (bridge: the director's page, the film's only by
  chance, without which the answer cannot be followed; comparison: one person). It names what the
  bridge lookup reads from the memory, the director, yet rarely answers alone;
* ``restated``: ``interpretation_only`` with, on bridge questions, the film's sentence as the memory
  words it between the two queries (``The film F was directed by P.``): the director is then written
  right after the words that precede him in the film's card summary;
* ``misrouted``: the good hints sent to each other's sub-agent.

``good``, ``first_hop`` and ``misrouted`` route by the index (which sub-agent holds which document):
they show what a broadcast with the right content does, not what a mid-agent can read.
`broadcast_from_memory` is the mid-agent that reads only its observation, the text
`MidAgentEnv.reset` returns: the regional memory and, with ``memory_card_summaries`` (on in
`HMARS_WORLD_ENV`), each sub-agent's card summary; `HMARS_WORLD_ENV` leaves the sub-agent map out
(``memory_map`` off), so the card summaries are the whole memory.

`RuleAnswerer` (``answerer: rule``, `coordrl.envs.hmars_roles`) stands in for the answer model: it
answers from the evidence pages in the answer prompt with
`coordrl.data.hmars_world.answer_from_evidence`, through the environment's own answer step
(`answer_messages`, ``<answer>`` parsing, exact match). The lexical answerer of the CPU config
replies with a whole sentence, so its exact match on this world is 0 whatever the evidence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from coordrl.data.hmars_world import (
    document_number,
    needed_queries,
    needed_titles,
    parse_question,
)
from coordrl.data.world import q_city, q_decade, q_director
from coordrl.envs.hmars_index import DocumentIndex
from coordrl.envs.hmars_roles import RuleAnswerer

__all__ = [
    "SCRIPTED",
    "RuleAnswerer",
    "broadcast_from_memory",
    "memory_entities",
    "owners",
    "scripted_broadcast",
    "use_rule_answerer",
]

SCRIPTED = ("question", "good", "first_hop", "interpretation_only", "second_hop", "restated", "misrouted")


def owners(row: dict[str, Any], index: DocumentIndex) -> list[int]:
    """The sub-agent holding each needed document (`needed_titles` order), from the index's pages.

    Raises ValueError when a needed document is not on exactly one sub-agent (a row that was not laid
    out with `coordrl.data.hmars_world.lay_out` for these settings and tokenizer).
    """
    out = []
    for title in needed_titles(row):
        doc = document_number(row, title)
        subs = {p.subagent for p in index.pages if doc in p.documents}
        if len(subs) != 1:
            raise ValueError(f"document {doc} ({title}) is on sub-agents {sorted(subs)}, expected one")
        out.append(subs.pop())
    return out


def scripted_broadcast(kind: str, row: dict[str, Any], index: DocumentIndex) -> tuple[str, dict[str, str]]:
    """``(interpretation, hints)`` of scripted broadcast ``kind`` (one of `SCRIPTED`) for ``row``."""
    queries = needed_queries(row)
    if kind == "question":
        return row["question"], {}
    if kind == "interpretation_only":
        return " ".join(queries), {}
    if kind == "second_hop":
        return queries[1], {}
    if kind == "restated":
        if row["type"] != "bridge":
            return " ".join(queries), {}
        film, director = needed_titles(row)
        return f"{queries[0]} The film {film} was directed by {director}. {queries[1]}", {}
    subs = owners(row, index)
    if kind == "good":
        return " ".join(queries), {f"s{s}": q for s, q in zip(subs, queries, strict=True)}
    if kind == "first_hop":
        return queries[0], {f"s{subs[0]}": queries[0]}
    if kind == "misrouted":
        return " ".join(queries), {f"s{s}": q for s, q in zip(subs[::-1], queries, strict=True)}
    raise ValueError(f"unknown scripted broadcast {kind!r}; use one of {', '.join(SCRIPTED)}")


# -- a mid-agent that reads only its observation ----------------------------------------------------

_SUB_LINE = re.compile(r"^- s(\d+) \([^)\n]*\): topics: [^\n]*?; entities: ([^\n]*)$", re.MULTILINE)
# A card summary line of the lexical writer: ``- s3: Documents 4-6. Title: first sentence. Title: ...``.
_CARD_LINE = re.compile(r"^- s(\d+): Documents [^.\n]*\. ([^\n]*)$", re.MULTILINE)
_CARD_TITLE = re.compile(r"(?:^|\. )([A-Z][\w'-]*): ")


def memory_entities(memory: str) -> dict[int, list[str]]:
    """Each sub-agent's entity list as the regional memory text shows it (``- s3 (...): ...; entities: A, B``);
    without a sub-agent map (``memory_map`` off), the titles its card summary line shows (``- s3:
    Documents 4-6. A: ... B: ...``), which are its own Documents."""
    found = {int(s): [e.strip() for e in ents.split(",") if e.strip()] for s, ents in _SUB_LINE.findall(memory)}
    return found or {int(s): _CARD_TITLE.findall(body) for s, body in _CARD_LINE.findall(memory)}


def _owner(name: str, entity_lists: Mapping[int, Sequence[str]]) -> int | None:
    """The sub-agent whose entity list names ``name`` earliest (titles come first in lexical lists)."""
    found = [(ents.index(name), s) for s, ents in entity_lists.items() if name in ents]
    return min(found)[1] if found else None


def broadcast_from_memory(question: str, memory: str) -> tuple[str, dict[str, str]]:
    """The broadcast a rule-following mid-agent makes from ``memory`` (the text `MidAgentEnv.reset`
    returns) and the question alone: no index, no chain.

    It routes each name to the sub-agent whose entity list (or card summary, `memory_entities`) shows it
    (earliest in the list) and, for a bridge question, takes the director from a sentence "The film <F>
    was directed by <P>" anywhere in the observation. Only the film's card summary holds that sentence:
    with ``memory_card_summaries`` the observation shows it and the bridge broadcast routes both hops;
    without, the lexical regional memory names the director but not as the film's, and the broadcast
    stops at the first hop. Falls back to the question for anything else.
    """
    parsed = parse_question(question)
    if parsed is None:
        return question, {}
    entity_lists = memory_entities(memory)
    kind, names = parsed
    if kind == "bridge":
        film = names[0]
        queries = [(film, q_director(film))]
        match = re.search(rf"\bThe film {re.escape(film)} was directed by (\w+)", memory)
        if match:
            queries.append((match.group(1), q_city(match.group(1))))
    else:
        queries = [(n, q_decade(n)) for n in names]
    hints: dict[str, str] = {}
    for name, query in queries:
        sub = _owner(name, entity_lists)
        if sub is not None:
            key = f"s{sub}"
            hints[key] = f"{hints[key]} {query}" if key in hints else query
    return " ".join(q for _, q in queries), hints


# -- the rule answer role -------------------------------------------------------------------------


def use_rule_answerer(factory: Any) -> RuleAnswerer:
    """Make ``factory``'s (an `HmarsEnvFactory`) answer role a `RuleAnswerer` (what ``answerer: rule``
    configures); returns it."""
    answerer = RuleAnswerer()
    factory.backends.answerer = answerer
    return answerer
