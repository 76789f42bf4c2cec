"""Scripted HMARS mid-agent broadcasts on the HMARS world: what a good broadcast is worth before any training.

Builds the held-out questions of the HMARS world (`coordrl.data.hmars_world`: the PARSER world's
held-out questions, each padded to 16 documents and laid out so its two needed documents lie on
different sub-agents) and runs every question through the environment training uses
(`HmarsEnvFactory` -> `MidAgentEnv.reset` -> ``broadcast`` -> ``info``), once per scripted broadcast
(`coordrl.envs.hmars_world.SCRIPTED`) and per answer role:

- roles: card and regional-memory writer **lexical**, page selector **lexical** (threshold and page
  sizes from `HMARS_WORLD_ENV`); answer role **rule** (`RuleAnswerer`: a model-free reader of the
  selected pages that follows the question's chain and says ``Unknown`` when a fact is missing, so its
  exact match measures whether the evidence suffices) and **lexical** (the CPU config's answerer,
  which replies with a whole sentence: exact match 0 on this world whatever the evidence); with
  ``--served-answerer``, also **reader** (a model: the kept world reader served by vLLM's CPU build,
  asked each hop of the question about each whole document of the selected pages, ``answer_chain``);
- ``memory``: `broadcast_from_memory` on the mid-agent's observation, the text `MidAgentEnv.reset`
  returns under `HMARS_WORLD_ENV` (each sub-agent's card summary, ``memory_card_summaries`` on, without
  the sub-agent map, ``memory_map`` off); ``memory, map`` with the sub-agent map (topics, entities,
  cross-references) too; ``memory, no cards`` on the map alone (the environment's default);
- ``dispatch`` (only hinted sub-agents select) with the good broadcast, and ``no_mid`` (every
  sub-agent selects from the question alone, whatever the broadcast);
- ``whole``: the selector scores the interpretation and each hint as one query part
  (``lexical_query_sentences`` off; the world scores each of their sentences alone), so the two
  questions of one interpretation dilute each other and only a hint on the right sub-agent selects.

It also reports what each of those three observations holds: whether each needed name is on its
sub-agent's line (routing readable: its entity list, or its card summary's titles without the map),
whether the bridge's director is named, whether "film F was directed by P" is stated, and its tokens.

    python benchmarks/hmars_world_broadcasts.py [--questions 100] [--seed 0] [--tokenizer SPEC] [--out FILE]
        [--served-answerer [--vllm-python PATH]]

``--tokenizer``: the tokenizer pages are cut with (default: the shipped one, the environment's
default; pass the policy's tokenizer folder to lay out and index the world as training would).
Offline, CPU only, about a minute on 2 cores (``--served-answerer``: plus the server's start and its
replies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from coordrl.data.hmars_world import HMARS_WORLD_ENV, N_DOCS, hmars_world_splits, needed_titles
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.hmars import HmarsEnvConfig, HmarsEnvFactory
from coordrl.envs.hmars_index import DocumentIndex
from coordrl.envs.hmars_world import (
    broadcast_from_memory,
    memory_entities,
    owners,
    scripted_broadcast,
    use_rule_answerer,
)

Broadcast = Callable[[dict[str, Any], str, DocumentIndex], tuple[str, dict[str, str]]]


def _scripted(kind: str) -> Broadcast:
    return lambda row, memory, index: scripted_broadcast(kind, row, index)


def _from_memory(row: dict[str, Any], memory: str, index: DocumentIndex) -> tuple[str, dict[str, str]]:
    return broadcast_from_memory(row["question"], memory)


# (variant, mode, settings that differ from HMARS_WORLD_ENV, broadcast); the scripted broadcasts do not
# read the observation, so only the memory reader runs on the other observations. The ``whole`` rows
# score the interpretation and each hint as one query part (``lexical_query_sentences`` off).
MAP = (("memory_map", True),)
NO_CARDS = (("memory_map", True), ("memory_card_summaries", False))
OBSERVATIONS = {"world": (), "map": MAP, "no_cards": NO_CARDS}
WHOLE = (("lexical_query_sentences", False),)
VARIANTS: list[tuple[str, str, tuple[tuple[str, bool], ...], Broadcast]] = [
    ("question", "full", (), _scripted("question")),
    ("good", "full", (), _scripted("good")),
    ("first_hop", "full", (), _scripted("first_hop")),
    ("interpretation_only", "full", (), _scripted("interpretation_only")),
    ("second_hop", "full", (), _scripted("second_hop")),
    ("misrouted", "full", (), _scripted("misrouted")),
    ("interpretation_only, whole", "full", WHOLE, _scripted("interpretation_only")),
    ("misrouted, whole", "full", WHOLE, _scripted("misrouted")),
    ("good, whole", "full", WHOLE, _scripted("good")),
    ("memory", "full", (), _from_memory),
    ("memory, map", "full", MAP, _from_memory),
    ("memory, no cards", "full", NO_CARDS, _from_memory),
    ("good", "dispatch", (), _scripted("good")),
    ("good", "no_mid", (), _scripted("good")),
]
ANSWERERS = ("rule", "lexical")
SERVED = "reader"  # the served world reader as the answer role (--served-answerer)


def observation_check(row: dict[str, Any], observations: dict[str, str], index: DocumentIndex, tok) -> dict[str, float]:
    """What the mid-agent can read in each observation (`OBSERVATIONS` tag -> text): routing (each needed
    name on its owner's line, `memory_entities`), the bridge director named, the film -> director
    sentence stated, and the observation's tokens."""
    names = needed_titles(row)
    subs = owners(row, index)
    out: dict[str, float] = {}
    for tag, memory in observations.items():
        lists = memory_entities(memory)
        out[f"routing_readable_{tag}"] = float(all(n in lists.get(s, []) for n, s in zip(names, subs, strict=True)))
        out[f"tokens_{tag}"] = len(tok(memory, add_special_tokens=False)["input_ids"])
        if row["type"] == "bridge":
            film, director = names
            out[f"director_named_{tag}"] = float(re.search(rf"\b{director}\b", memory) is not None)
            stated = re.search(rf"\bThe film {film} was directed by {director}\b", memory)
            out[f"relation_stated_{tag}"] = float(stated is not None)
    return out


def run(n_per_type: int, seed: int, tokenizer: str | None, served: tuple[str, str] | None = None) -> dict[str, Any]:
    """The table and observation figures; ``served``: (URL, model) of a world reader server, which then
    answers too (answerer ``reader``)."""
    answerers = (*ANSWERERS, SERVED) if served else ANSWERERS
    tok = load_tokenizer(tokenizer)
    t0 = time.perf_counter()
    rows = hmars_world_splits(0, 2 * n_per_type, seed, tokenizer=tok)["heldout"]
    build_s = time.perf_counter() - t0
    factories: dict[tuple[str, tuple[tuple[str, bool], ...], str], HmarsEnvFactory] = {}
    for mode, changed in sorted({(mode, changed) for _, mode, changed, _ in VARIANTS}):
        for answerer in answerers:
            settings = {**HMARS_WORLD_ENV, "mode": mode, **dict(changed)}
            if answerer == SERVED:
                settings.update(answerer=served[0], answerer_model=served[1], answerer_api_key_env=None)
                settings["answer_chain"] = True
            f = HmarsEnvFactory(HmarsEnvConfig(**settings), tokenizer=tok)
            if answerer == "rule":
                use_rule_answerer(f)
            factories[(mode, changed, answerer)] = f
    results: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    observed: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    shapes: dict[str, list[float]] = defaultdict(list)
    t0 = time.perf_counter()
    for row in rows:
        for variant, mode, changed, broadcast in VARIANTS:
            for answerer in answerers:
                env = factories[(mode, changed, answerer)]()
                memory = env.reset(**row).strip()
                interpretation, hints = broadcast(row, memory, env.index)
                reply = asyncio.run(env.broadcast(interpretation, hints))
                if reply.startswith("Error"):
                    raise RuntimeError(f"{row['id']} {variant}: {reply}")
                info = env.info
                r = results[(variant, mode, row["type"])]
                r[f"em_{answerer}"].append(info["em"])
                if answerer == "rule":
                    for key in ("recall", "pages_selected", "evidence_tokens"):
                        r[key].append(info[key])
        observations = {}
        for tag, changed in OBSERVATIONS.items():
            env = factories[("full", changed, "rule")]()
            observations[tag] = env.reset(**row).strip()
        for key, value in observation_check(row, observations, env.index, tok).items():
            observed[row["type"]][key].append(value)
        shapes["subagents"].append(env.index.num_subagents)
        shapes["tokens"].append(env.index.num_tokens)
    episodes_s = time.perf_counter() - t0
    for f in factories.values():
        f.close()
    table = [
        {
            "variant": variant,
            "mode": mode,
            "type": qtype,
            "n": len(r["recall"]),
            **{k: round(statistics.fmean(v), 4) for k, v in r.items()},
        }
        for (variant, mode, qtype), r in results.items()
    ]
    return {
        "questions_per_type": n_per_type,
        "seed": seed,
        "tokenizer": tokenizer or "coordrl-tiny (shipped)",
        "n_docs": N_DOCS,
        "settings": HMARS_WORLD_ENV,
        "roles": {
            "writer": "lexical",
            "selector": "lexical",
            "answer": "rule, lexical"
            + (f" and reader ({served[1]} at {served[0]}, answer_chain)" if served else "")
            + " (separate runs)",
        },
        "subagents_per_question": [min(shapes["subagents"]), max(shapes["subagents"])],
        "tokens_per_question": [min(shapes["tokens"]), max(shapes["tokens"])],
        "build_s": round(build_s, 2),
        "episodes_s": round(episodes_s, 2),
        "episodes": len(rows) * len(VARIANTS) * len(answerers),
        "table": table,
        "observation": {
            qtype: {k: round(statistics.fmean(v), 4) for k, v in obs.items()} for qtype, obs in observed.items()
        },
    }


def print_report(out: dict[str, Any]) -> None:
    s = out["settings"]
    print(
        f"HMARS world, {out['questions_per_type']} held-out questions per type (seed {out['seed']}), "
        f"{out['n_docs']} documents = {out['tokens_per_question'][0]}-{out['tokens_per_question'][1]} tokens "
        f"({out['tokenizer']}), {out['subagents_per_question'][0]}-{out['subagents_per_question'][1]} sub-agents "
        f"of {s['c_sub']} tokens in {s['page_tokens']}-token pages, one mid-agent"
    )
    print(
        "roles: writer lexical, selector lexical (threshold "
        f"{s['lexical_select_threshold']}, {s['pages_per_subagent']} page per sub-agent"
        + (", each query sentence scored alone" if s.get("lexical_query_sentences") else "")
        + "); answer: rule "
        "(model-free reader of the selected pages) and lexical (the CPU config's, answers a sentence); observation: "
        + ("regional memory" if s.get("memory_map", True) else "memory header")
        + (" + card summaries" if s.get("memory_card_summaries") else "")
    )
    print(f"{out['episodes']} episodes in {out['episodes_s']} s (world built in {out['build_s']} s)\n")
    reader = any(f"em_{SERVED}" in r for r in out["table"])
    head = f"{'broadcast':<26} {'mode':<9} {'type':<11} {'EM rule':>7} {'EM lex':>6}" + (
        f" {'EM reader':>9}" if reader else ""
    )
    head += f" {'recall':>6} {'pages':>5} {'ev.tok':>6}"
    print(head)
    print("-" * len(head))
    for r in out["table"]:
        print(
            f"{r['variant']:<26} {r['mode']:<9} {r['type']:<11} {r['em_rule']:>7.2f} {r['em_lexical']:>6.2f}"
            + (f" {r[f'em_{SERVED}']:>9.2f}" if reader else "")
            + f" {r['recall']:>6.3f} {r['pages_selected']:>5.2f} {r['evidence_tokens']:>6.1f}"
        )
    print("\nwhat the mid-agent can read (share of questions; tokens_*: mean tokens of the observation):")
    for qtype, obs in out["observation"].items():
        print(f"  {qtype:<11} " + ", ".join(f"{k} {v:g}" for k, v in obs.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=100, help="held-out questions per type (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="world seed (default 0)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer pages are cut with (default: the shipped one)")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    parser.add_argument(
        "--served-answerer",
        action="store_true",
        help="also answer with the kept world reader served by vLLM's CPU build (needs .venv-vllm)",
    )
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm (default .venv-vllm/bin/python)")
    args = parser.parse_args(argv)
    if not args.served_answerer:
        out = run(args.questions, args.seed, args.tokenizer)
    else:
        from coordrl.data.world_reader import world_reader_dir
        from coordrl.readers.serve import start_reader_servers

        model = str(world_reader_dir())
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with start_reader_servers(model, cpu=True, port_base=port, python=args.vllm_python) as group:
            out = run(args.questions, args.seed, args.tokenizer, served=(group.urls[0], model))
    print_report(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
