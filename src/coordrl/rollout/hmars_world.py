"""HMARS world episodes for a policy: environment factory, prompt, scripted demonstrations rendered
as TRL renders rollouts, and batched held-out evaluation through `StepEnv`.

The HMARS world's data is `coordrl.data.hmars_world`; its scripted broadcasts and the rule answer role
are `coordrl.envs.hmars_world`. Episodes here use `HMARS_WORLD_ENV` with ``answerer: rule`` (the
frozen answer model is model-free: its exact match says whether the selected pages hold the evidence),
the lexical card writer and selector, and `HMARS_WORLD_SYSTEM_PROMPT`, as
``configs/hmars_world_cpu.yaml`` trains.
"""

from __future__ import annotations

import json
from typing import Any

from coordrl.data.hmars_world import HMARS_WORLD_ENV, HMARS_WORLD_SYSTEM_PROMPT
from coordrl.envs.chat import ChatCodec
from coordrl.envs.hmars import HmarsEnvConfig, HmarsEnvFactory
from coordrl.envs.hmars_prompts import hmars_prompt
from coordrl.envs.hmars_world import scripted_broadcast
from coordrl.envs.step import StepEnv, play
from coordrl.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN
from coordrl.rollout.world import batch_actor, per_type_means, scripted_ids

__all__ = [
    "HMARS_WORLD_POLICY_ENV",
    "broadcast_call_text",
    "evaluate_hmars_world",
    "hmars_demo_ids",
    "hmars_world_prompt",
    "make_hmars_env_factory",
]

# The world's settings with the rule answer role: what the HMARS world config trains with.
HMARS_WORLD_POLICY_ENV: dict[str, Any] = {**HMARS_WORLD_ENV, "answerer": "rule"}
MAX_TURNS = 1  # one broadcast, then the answer turn


def hmars_world_prompt(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation `coordrl train` gives ``row`` under ``configs/hmars_world_cpu.yaml``."""
    return hmars_prompt(row["question"], HMARS_WORLD_SYSTEM_PROMPT)


def make_hmars_env_factory(tokenizer, **overrides: Any):
    return HmarsEnvFactory(HmarsEnvConfig(**{**HMARS_WORLD_POLICY_ENV, **overrides}), tokenizer=tokenizer)


def broadcast_call_text(interpretation: str, hints: dict[str, str]) -> str:
    """A ``broadcast`` tool call as the policy writes it (the chat template's tool-call format)."""
    call = {"name": "broadcast", "arguments": {"interpretation": interpretation, "hints": hints}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def _answer_turn(answer: str | None) -> str:
    # A leading space keeps a name the same token as in the tool result.
    return f"{ANSWER_OPEN} {answer or ''}{ANSWER_CLOSE}"


def hmars_demo_ids(row: dict[str, Any], kind: str, codec, factory) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of a scripted episode (broadcast ``kind`` of
    `coordrl.envs.hmars_world.SCRIPTED`, then the answer the tool reported) built exactly as TRL builds
    a rollout: prompt ids with TRL's training template, assistant turns (loss 1), the tool-response
    suffix (loss 0)."""
    env = StepEnv(factory(), codec, max_turns=MAX_TURNS, prompt_fn=hmars_world_prompt, require_stop=False)
    env.reset(**row)
    call = broadcast_call_text(*scripted_broadcast(kind, row, env.env.index))
    # The broadcast, then the answer the tool reported (known only after the broadcast ran).
    return scripted_ids(env, codec, lambda i: call if i == 0 else _answer_turn(env.env.answer) if i == 1 else None)


def evaluate_hmars_world(
    model,
    tokenizer,
    rows: list[dict[str, Any]],
    *,
    sample: bool,
    seed: int = 0,
    batch_size: int = 32,
    max_new_tokens: int = 128,
    env_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Exact match of the frozen answer role (the episode's reward) and supporting-page recall per
    question type, for ``model`` as the mid-agent on ``rows`` (laid out with ``tokenizer``). Episodes
    run in batches through `StepEnv` (TRL's parsing, tools and caps). ``sample``: temperature 1, else
    greedy. ``env_overrides``: settings replacing `HMARS_WORLD_POLICY_ENV` (e.g. ``mode="no_mid"``,
    ``mode="dispatch"`` for the ablations). ``<type>_broadcast`` is the share of episodes whose
    broadcast ran."""
    import torch

    codec = ChatCodec(tokenizer)
    factory = make_hmars_env_factory(tokenizer, **(env_overrides or {}))
    torch.manual_seed(seed)
    act = batch_actor(model, tokenizer, sample=sample, max_new_tokens=max_new_tokens)
    results: list[tuple[str, float, float, int]] = []
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            envs = [
                StepEnv(factory(), codec, max_turns=MAX_TURNS, prompt_fn=hmars_world_prompt, require_stop=False)
                for _ in batch
            ]
            for env, row in zip(envs, batch, strict=True):
                env.reset(**row)
            play(envs, act, MAX_TURNS + 1)
            for env, row in zip(envs, batch, strict=True):
                info = env.env.info
                ran = int(info.get("broadcasts", 0) > 0)
                results.append((row["type"], float(env.env.get_reward()), float(info.get("recall", 0.0)) * ran, ran))
    finally:
        factory.close()
    return per_type_means(results, ("", "_recall", "_broadcast"))
