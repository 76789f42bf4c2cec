"""How sure an HMARS world mid-agent is of the name its broadcast must read from the memory.

A bridge question names the film, never its director; the broadcast that gets both pages selected asks
where the director was born, and the director's name is read from the film's card summary in the
observation. This benchmark measures that one step with the answer given up to it: each held-out question's
complete hint-free broadcast (``interpretation_only`` of `coordrl.envs.hmars_world.SCRIPTED`, built as the
warm-start builder builds its demonstrations) is fed up to the second query's name, and the model's
next-token distribution is read there. For a comparison question the name is the second compared person,
which the question does name.

Printed per question type: ``p(name)``, the mean probability of the right name (what sampling at
temperature 1 draws), and ``argmax``, the share of questions where it is the likeliest token (what greedy
decoding writes). The prefix is the demonstrations' wording; a trained policy that words its broadcast
otherwise is still read at this one. On the ten trained policies of docs/hmars_world.md, sampled bridge
exact match was ``p(name)`` times the share of sampled broadcasts that ran, within 8 points: nothing later
in an episode repairs a wrong name.

    python benchmarks/hmars_lookup.py MODEL [MODEL ...] [--questions 100] [--kind interpretation_only]

Offline, CPU, a forward pass per question and model: about ten seconds per model on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def lookup_prefixes(tok, n: int, kind: str = "interpretation_only") -> list[tuple[str, list[int], int]]:
    """``(type, prompt-and-call ids up to the name, the name's token id)`` for the first ``n`` held-out
    questions, laid out with ``tok`` (it must tokenize every world name as one token, as the kept
    tokenizer does), in the wording of scripted broadcast ``kind``."""
    from coordrl.data.hmars_world import hmars_world_rows, needed_titles
    from coordrl.envs.chat import ChatCodec
    from coordrl.rollout.hmars_world import hmars_demo_ids, make_hmars_env_factory

    # The held-out split of `hmars_world_splits` (drawn before the training questions, which it excludes).
    rows, _ = hmars_world_rows(n, 0, prefix="heldout", tokenizer=tok)
    codec, factory = ChatCodec(tok), make_hmars_env_factory(tok, lexical_query_sentences=False)
    out = []
    try:
        for row in rows:
            ids, mask = hmars_demo_ids(row, kind, codec, factory)
            name = needed_titles(row)[1]
            name_ids = tok(f" {name}", add_special_tokens=False)["input_ids"]
            if len(name_ids) != 1:
                raise ValueError(
                    f"the tokenizer cuts the world name {name!r} into {len(name_ids)} tokens; use a world policy's"
                )
            name_id = name_ids[0]
            # The name's first occurrence in the policy's own turn: the second query of the interpretation.
            at = next(i for i in range(mask.index(1), len(ids)) if ids[i] == name_id)
            out.append((row["type"], ids[:at], name_id))
    finally:
        factory.close()
    return out


@torch.no_grad()
def measure(model, prefixes: list[tuple[str, list[int], int]]) -> dict[str, dict[str, float]]:
    """Per question type: mean p(right name) and the share of questions where it is the argmax."""
    seen: dict[str, list[tuple[float, int]]] = {}
    for kind, ids, name_id in prefixes:
        probs = model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)
        seen.setdefault(kind, []).append((probs[name_id].item(), int(probs.argmax().item() == name_id)))
    return {
        kind: {"p_name": round(sum(p for p, _ in v) / len(v), 3), "argmax": round(sum(a for _, a in v) / len(v), 3)}
        for kind, v in sorted(seen.items())
    }


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coordrl.rollout.models import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="policy folders or coordrl: model names")
    p.add_argument("--questions", type=int, default=100, help="held-out questions (default 100)")
    p.add_argument(
        "--kind",
        default="interpretation_only",
        help="scripted broadcast whose wording the prefix takes (default interpretation_only; restated: the "
        "film's sentence before the second query, so the director follows 'was directed by')",
    )
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    paths = [resolve_model(m) for m in a.models]
    prefixes = lookup_prefixes(AutoTokenizer.from_pretrained(paths[0]), a.questions, a.kind)
    for spec, path in zip(a.models, paths, strict=True):
        model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32).eval()
        print(json.dumps({"model": spec, **measure(model, prefixes)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
