"""The synthetic world's episode helpers: its tokenizer, prompt, environment factory, scripted
demonstrations rendered as TRL renders rollouts, and batched held-out evaluation through `StepEnv`.

The world itself (entities, questions, datasets) is data: `coordrl.data.world`.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from coordrl.data.tokenizer import _synthetic_tool_texts, train_tokenizer
from coordrl.data.world import (
    QUESTION_TYPES,
    WORLD_ENV,
    WORLD_SPLIT_PATTERN,
    WORLD_SYSTEM_PROMPT,
    World,
    bridge_question,
    comparison_question,
    make_question,
    make_world,
    q_city,
    q_decade,
    scripted_turns,
    tool_call_text,
)
from coordrl.envs.chat import ChatCodec
from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory
from coordrl.envs.prompts import LEAD_SYSTEM_PROMPT, lead_prompt
from coordrl.envs.step import StepEnv, play
from coordrl.software import software


def _corpus_texts(world: World) -> list[str]:
    """Text the world tokenizer is trained on: names, templates, prompts and tool-call shapes."""
    texts = [
        LEAD_SYSTEM_PROMPT,
        WORLD_SYSTEM_PROMPT,
        "Question: ",
        "Unknown",
        "dummy",
        "{}}",
        '{"dummy": {}}',
    ]
    rng = random.Random(0)
    names = list(world.names)
    for name in names:
        for _ in range(3):
            texts.append(f" {name}")
        texts.append(f"Document 1:\n{name}\n{name}: {name}.")
    for _ in range(200):
        row, _ = make_question(rng, world, rng.choice(QUESTION_TYPES))
        texts.append(row["question"])
        texts.append(row["context"])
    qs = [bridge_question(f) for f in world.films[:20]] + [
        comparison_question(a, b) for a, b in zip(world.people[:20], world.people[20:40], strict=True)
    ]
    texts.extend(_synthetic_tool_texts(qs, list(world.people[:40])))
    for p in world.people[:40]:
        texts.append(
            json.dumps(
                {
                    "name": "query_agents",
                    "arguments": {"queries": [q_city(p), q_decade(p)]},
                }
            )
        )
        texts.append(f"<answer> {p}</answer>")
    return texts


def build_world_tokenizer(seed: int = 0, extra_texts: list[str] | None = None, vocab_size: int = 4096):
    """The world tokenizer (a ``PreTrainedTokenizerFast``); see the module docstring.

    Raises ValueError when some entity name is not a single leading-space token.
    """
    world = make_world(seed)
    # Every name must be one token: merge pairs seen once, and split words the world's way.
    tok = train_tokenizer(
        _corpus_texts(world) + list(extra_texts or []),
        vocab_size,
        split_pattern=WORLD_SPLIT_PATTERN,
        min_frequency=1,
    )
    bad = [n for n in world.names if len(tok(f" {n}", add_special_tokens=False)["input_ids"]) != 1]
    if bad:
        raise ValueError(f"{len(bad)} names are not single tokens (e.g. {bad[:5]}); raise vocab_size")
    return tok


def with_world_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the ``prompt`` column `coordrl train` gives it under configs/world_cpu.yaml."""
    return {**row, "prompt": lead_prompt(row["question"], WORLD_SYSTEM_PROMPT)}


def make_env_factory(tokenizer, **overrides: Any):
    return ParserEnvFactory(ParserEnvConfig(**{**WORLD_ENV, **overrides}), tokenizer=tokenizer)


def demo_ids(
    row: dict[str, Any],
    good: bool,
    codec,
    factory,
    max_completion_tokens: int | None = None,
) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of a scripted episode built exactly as TRL builds a rollout: prompt ids with
    TRL's training template, each assistant turn's ids (loss 1), each tool round's suffix ids (loss 0)."""
    env = StepEnv(
        factory(),
        codec,
        max_turns=WORLD_ENV["max_turns"],
        max_completion_tokens=max_completion_tokens,
    )
    env.reset(**with_world_prompt(row))
    turns = scripted_turns(row, good)
    return scripted_ids(env, codec, lambda i: turns[i] if i < len(turns) else None)


def scripted_ids(env, codec, next_turn) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of the scripted episode a reset `StepEnv` plays: ``next_turn(i)`` gives
    assistant turn ``i`` as text (None ends the episode), read after turn ``i - 1``'s tool results.
    Prompt ids with TRL's training template (loss 0), each assistant turn's ids (loss 1), each tool
    round's suffix ids (loss 0)."""
    ids, mask = list(env.prompt_ids), [0] * len(env.prompt_ids)
    i = 0
    while (turn := next_turn(i)) is not None:
        before = len(env.completion_ids)
        step = env.step(turn)
        n_turn = len(codec.encode_turn(turn))
        new = env.completion_ids[before:]
        ids += new
        mask += [1] * n_turn + [0] * (len(new) - n_turn)
        if step.terminated or step.truncated:
            break
        i += 1
    return ids, mask


def per_type_means(results: list[tuple], names: tuple[str, ...]) -> dict[str, float]:
    """Means per question type (and ``all``) of per-episode ``(type, value, ...)`` tuples: value ``j``
    (after the type) is reported as ``<type><names[j]>`` (``""``: the bare type)."""
    out: dict[str, float] = {}
    for qtype in QUESTION_TYPES + ("all",):
        sel = [r for r in results if qtype == "all" or r[0] == qtype]
        if sel:
            for j, name in enumerate(names, start=1):
                out[f"{qtype}{name}"] = sum(r[j] for r in sel) / len(sel)
    return out


def publish_warm_start(tmp: Path, out: Path, meta: dict[str, Any], t0: float, log=print) -> None:
    """Finish a warm-start build: write ``meta`` and the build's `coordrl.software.software` as
    ``coordrl_warm_start.json`` into the build folder ``tmp``, then replace ``out`` with it (a reader of
    ``out`` never sees a half-written model), and log size and wall time (since ``t0``) against the
    10-minute target."""
    import shutil

    meta = {**meta, "software": software()}
    (tmp / "coordrl_warm_start.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    took = time.time() - t0
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    verdict = "met" if took <= 600 else "NOT met"
    log(f"wrote {out} ({size:.1f} MB) in {took:.0f}s (target <= 600s on an idle 2-core machine: {verdict})")


def batch_actor(model, tokenizer, *, sample: bool, max_new_tokens: int):
    """The ``act`` of `coordrl.envs.step.play` for an in-process model: one turn for every running
    episode, generated as one left-padded batch (``sample``: temperature 1, top-k and top-p off;
    else greedy), cut after EOS. Puts ``model`` in eval mode."""
    import torch

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.eval()
    gen_kwargs = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0} if sample else {"do_sample": False}

    def act(running) -> list[list[int]]:
        ctx = [env.context_ids for env in running]
        width = max(map(len, ctx))
        inp = torch.tensor([[pad] * (width - len(c)) + c for c in ctx])
        att = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in ctx])
        with torch.no_grad():
            out = model.generate(
                inp, attention_mask=att, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                **gen_kwargs,
            )  # fmt: skip
        turns = []
        for row_i in range(len(running)):
            new = out[row_i, width:].tolist()
            if eos in new:
                new = new[: new.index(eos) + 1]
            else:
                while new and new[-1] == pad:
                    new.pop()
            turns.append(new)
        return turns

    return act


def evaluate_world(
    model,
    tokenizer,
    rows: list[dict[str, Any]],
    *,
    sample: bool,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = 48,
    max_completion_tokens: int | None = 1024,
    mapreduce: bool = False,
    env_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Exact match per question type of ``model`` on ``rows``, episodes run in batches through `StepEnv`
    (the same parsing, tools, suffixes and caps as TRL's loop). ``sample``: temperature 1, else greedy.
    ``mapreduce``: the one-round baseline: a scripted first turn broadcasts the question itself, then
    the model has one turn to answer from those findings. ``env_overrides``: environment settings
    replacing the world's (e.g. ``activation="routed"``), so a policy is evaluated in the
    environment it was trained in. Besides exact match, ``<type>_reader_calls`` is the mean number
    of reader calls per episode."""
    import torch

    codec = ChatCodec(tokenizer)
    factory = make_env_factory(tokenizer, **(env_overrides or {}))
    torch.manual_seed(seed)
    results: list[tuple[str, float, int, int]] = []
    act = batch_actor(model, tokenizer, sample=sample, max_new_tokens=max_new_tokens)

    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            turns = 1 if mapreduce else WORLD_ENV["max_turns"]
            envs = [
                StepEnv(
                    factory(),
                    codec,
                    max_turns=turns,
                    max_completion_tokens=max_completion_tokens,
                )
                for _ in batch
            ]
            for env, row in zip(envs, batch, strict=True):
                env.reset(**with_world_prompt(row))
                if mapreduce:
                    env.step(tool_call_text([row["question"]]))
            outcomes = play(envs, act, WORLD_ENV["max_turns"] + 1)
            # An episode the policy left (no tokens, or turns ran out) scores 0 here, whatever truncate() computed.
            rewards = [o.step.reward if o.ended_by_env else 0.0 for o in outcomes]
            for env, row, r in zip(envs, batch, rewards, strict=True):
                results.append((row["type"], r, env.tool_rounds, int(env.info.get("reader_calls", 0))))
    finally:
        factory.close()  # served readers hold connection pools
    return per_type_means(results, ("", "_tool_rounds", "_reader_calls"))
