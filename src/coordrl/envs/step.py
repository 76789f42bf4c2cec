"""A gym-style ``reset`` / ``step`` driver for TRL-style environments, for code outside TRL.

Evaluation, inference and ``coordrl rollout`` drive episodes through `StepEnv`. Each step takes one
assistant turn (generated ids, or text) and does what TRL's tool loop does with it: parse it with
TRL's parser against the same prompt ids, execute its tool calls on the environment (errors become
``{'error': ...}`` tool results, as in TRL), append the tool-response suffix ids by concatenation,
and stop at the same tool-round cap and completion budget. A policy therefore behaves the same in
``eval`` as in ``train``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from coordrl.envs.chat import ChatCodec, env_tools
from coordrl.envs.prompts import lead_prompt
from coordrl.envs.tool_input import repair_text, safe_str
from coordrl.rewards import ends_with_stop, exact_match_reward

# A tool-call opener left in a turn's text: the turn asked for a tool the parser could not read.
_RAW_TOOL_CALL = "<tool_call>"


def default_prompt(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The dataset's ``prompt`` column when present (training rows have one), else the lead prompt."""
    prompt = row.get("prompt")
    return [dict(m) for m in prompt] if prompt else lead_prompt(row["question"])


@dataclass
class Step:
    """What one `StepEnv.step` returns (also unpackable as a 5-tuple)."""

    observation: str | None
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]

    def __iter__(self):
        return iter((self.observation, self.reward, self.terminated, self.truncated, self.info))


class StepEnv:
    """Drive one environment instance turn by turn.

    Args:
        env: a TRL-style environment (``reset(**row)`` + tool methods), e.g. `ParserLeadEnv`.
        codec: the policy tokenizer's `ChatCodec`.
        max_turns: tool rounds allowed (TRL's ``max_tool_calling_iterations``).
        max_completion_tokens: TRL's ``max_completion_length`` (all turns and tool results); None: unlimited.
        reward_fn: TRL-style reward function (default exact match of the tagged answer).
        prompt_fn: builds the prompt conversation from a row.
        require_stop: an episode whose last turn never ended (no EOS: cut off by the per-turn or the
            completion token cap) scores 0, as `coordrl.train.reward.EpisodeReward` scores it in
            training (default True; False where the environment owns the reward, as HMARS does).
    """

    def __init__(
        self,
        env: Any,
        codec: ChatCodec,
        *,
        max_turns: int,
        max_completion_tokens: int | None = None,
        reward_fn: Callable[..., list[float]] = exact_match_reward,
        prompt_fn: Callable[[dict[str, Any]], list[dict[str, Any]]] = default_prompt,
        require_stop: bool = True,
    ) -> None:
        self.env = env
        self.require_stop = require_stop
        self.codec = codec
        self.max_turns = max_turns
        self.max_completion_tokens = max_completion_tokens
        self.reward_fn = reward_fn
        self.prompt_fn = prompt_fn
        self.tools = env_tools(env)
        self._tool_by_name = {t.__name__: t for t in self.tools}
        self._start({}, [], [])
        self.done = True  # until reset()

    # -- episode ------------------------------------------------------------------------------------

    def reset(self, **row: Any) -> list[dict[str, Any]]:
        """Bind a sample; returns the prompt conversation the policy starts from."""
        observation = self.env.reset(**row)
        prompt = self.prompt_fn(row)
        if isinstance(observation, str):
            prompt[-1] = {**prompt[-1], "content": prompt[-1]["content"] + observation}
        self._start(row, prompt, self.codec.prompt_ids(prompt, self.tools))
        return list(self.messages)

    def _start(self, row: dict[str, Any], prompt: list[dict[str, Any]], prompt_ids: list[int]) -> None:
        """A fresh episode's state: the conversation so far and every per-episode counter at zero."""
        self._row = row
        self.messages: list[dict[str, Any]] = list(prompt)
        self.completion: list[dict[str, Any]] = []
        self.prompt_ids: list[int] = prompt_ids
        self.completion_ids: list[int] = []
        self.tool_rounds = 0
        self.tool_failures = 0
        self.malformed_tool_calls = 0
        self.invalid_text_turns = 0
        self.lead_tokens = 0
        self.done = False

    @property
    def context_ids(self) -> list[int]:
        """Ids the policy generates from next: prompt + every turn and tool result so far."""
        return self.prompt_ids + self.completion_ids

    @property
    def info(self) -> dict[str, Any]:
        base = dict(getattr(self.env, "info", {}) or {})
        base.update(
            tool_rounds=self.tool_rounds,
            tool_failures=self.tool_failures,
            malformed_tool_calls=self.malformed_tool_calls,
            invalid_text_turns=self.invalid_text_turns,
            assistant_turns=sum(1 for m in self.completion if m.get("role") == "assistant"),
            completion_tokens=len(self.completion_ids),
            unfinished=int(self.done and not self.stopped),
            lead_tokens=self.lead_tokens,
        )
        if "reader_cost" in base:  # the environment's reader tokens, already weighted into lead-token units
            base["normalised_cost"] = self.lead_tokens + base["reader_cost"]
        return base

    def step(self, action: str | Sequence[int]) -> Step:
        """Synchronous `astep` (must not be called from a running event loop; use ``await astep``)."""
        return asyncio.run(self.astep(action))

    async def astep(self, action: str | Sequence[int]) -> Step:
        """Apply one assistant turn: generated ids (ending with EOS when the model stopped) or text.

        Text that UTF-8 cannot encode (lone surrogates, which a policy served over JSON can return)
        has them replaced by U+FFFD, counted in ``info["invalid_text_turns"]``. A turn holding a tool
        call that does not parse (bad JSON, or nesting refused by `ChatCodec.parse`) ends the
        episode without an answer, as in TRL, and is counted in ``info["malformed_tool_calls"]``.
        """
        if self.done:
            raise RuntimeError("episode is over; call reset() first")
        if isinstance(action, str):
            action, replaced = repair_text(action)
            self.invalid_text_turns += int(replaced > 0)
            ids = self.codec.encode_turn(action)
        else:
            ids = list(action)
        message = self.codec.parse(ids, self.context_ids, self.tools)
        # The lead read its whole context and wrote this turn: E-mem's cost counts both, every turn.
        self.lead_tokens += len(self.context_ids) + len(ids)
        self.completion_ids += ids
        self.messages.append(message)
        self.completion.append(message)
        calls = message.get("tool_calls")
        if not calls:
            self.malformed_tool_calls += int(_RAW_TOOL_CALL in str(message.get("content") or ""))
            return self._finish(terminated=True)
        if self.tool_rounds >= self.max_turns:
            return self._finish(terminated=False)  # turn cap: ends on a tool call, scores 0 as in TRL
        tool_messages = [await self._call(call) for call in calls]
        suffix = self.codec.tool_suffix_ids(tool_messages)
        if (
            self.max_completion_tokens is not None
            and len(self.completion_ids) + len(suffix) > self.max_completion_tokens
        ):
            return self._finish(terminated=False)  # TRL drops tool results past the budget and stops
        self.completion_ids += suffix
        self.messages += tool_messages
        self.completion += tool_messages
        self.tool_rounds += 1
        observation = "\n\n".join(str(m["content"]) for m in tool_messages)
        return Step(observation, 0.0, False, False, self.info)

    def over_budget(self) -> bool:
        return self.max_completion_tokens is not None and len(self.completion_ids) >= self.max_completion_tokens

    def truncate(self) -> Step:
        """End the episode from outside (e.g. the completion budget ran out mid-generation)."""
        return self._finish(terminated=False)

    # -- internals ----------------------------------------------------------------------------------

    def _finish(self, terminated: bool) -> Step:
        self.done = True
        answers = self._row.get("answers") if self._row.get("answers") is not None else [self._row.get("answer", "")]
        reward = float(self.reward_fn([self.completion], answers=[answers])[0])
        if self.cut_off:
            reward = 0.0
        return Step(None, reward, terminated, not terminated, self.info)

    @property
    def stopped(self) -> bool:
        """Whether the last turn ended with EOS (False after a cut-off turn or before any turn)."""
        return ends_with_stop(self.completion_ids, self.codec.eos_token_id)

    @property
    def cut_off(self) -> bool:
        """Whether the episode has no answer because its last turn was cut off (``require_stop``)."""
        return self.require_stop and not self.stopped

    async def _call(self, call: dict[str, Any]) -> dict[str, Any]:
        # Mirrors TRL 1.16's tool loop: unknown tools and exceptions become {"error": ...} results.
        # Names, errors and results are printed with safe_str: the policy's JSON can spell a name
        # (or an argument echoed in an error) that UTF-8 cannot encode, and the tool message is tokenized.
        if call.get("type") != "function":
            self.tool_failures += 1
            error = {"error": f"Unsupported tool call type: {safe_str(call.get('type'), None)}"}
            return {"role": "tool", "name": safe_str(call.get("name", "unknown"), None), "content": str(error)}
        function = call["function"]
        name = function["name"]
        try:
            tool = self._tool_by_name.get(name) if isinstance(name, str) else None
            if tool is None:
                raise ValueError(f"Tool {safe_str(name, None)} not found.")
            result = tool(**function["arguments"])
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:
            self.tool_failures += 1
            result = {"error": safe_str(e, None)}
        content = result if isinstance(result, list) else safe_str(result, None)
        return {"role": "tool", "name": safe_str(name, None), "content": content}


@dataclass
class Outcome:
    """How `play` ended one episode.

    ``reason``: ``terminated`` (the policy answered, or its turn could not be parsed), ``truncated``
    (a tool-round or completion-token cap), ``stopped`` (the caller's ``stop`` predicate held: the
    episode is not over, its environment may go on elsewhere), ``no_tokens`` (the policy produced
    nothing: its completion budget was spent) or ``turn_limit`` (``max_policy_turns`` ran out). The
    last two end the episode through `StepEnv.truncate`.
    """

    step: Step
    reason: str

    @property
    def ended_by_env(self) -> bool:
        """The environment ended the episode (an answer or a cap), not the caller or the policy."""
        return self.reason in ("terminated", "truncated")


def play(
    envs: Sequence[StepEnv],
    act: Callable[[list[StepEnv]], Sequence[str | Sequence[int]]],
    max_policy_turns: int,
    stop: Callable[[StepEnv], bool] | None = None,
) -> list[Outcome]:
    """The episode loop: every rollout, evaluation, inference and learning-check episode runs here.

    Each round asks ``act`` for one assistant turn per episode still running (a batch, so a model can
    generate them together; a single-episode policy returns a one-element list) and applies it with
    `StepEnv.step`. An episode leaves the loop when the environment ends it, when ``stop(env)``
    holds after a step, or when its turn is empty; after ``max_policy_turns`` turns the rest are
    truncated. The environments must already be reset.

    Returns:
        One `Outcome` per environment, in order.
    """
    outcomes: list[Outcome | None] = [None] * len(envs)
    active = list(range(len(envs)))
    for _ in range(max_policy_turns):
        if not active:
            break
        actions = act([envs[i] for i in active])
        still = []
        for i, action in zip(active, actions, strict=True):
            if not action and not isinstance(action, str):  # no tokens at all: the completion budget is spent
                outcomes[i] = Outcome(envs[i].truncate(), "no_tokens")
                continue
            step = envs[i].step(action)
            if step.terminated or step.truncated:
                outcomes[i] = Outcome(step, "terminated" if step.terminated else "truncated")
            elif stop is not None and stop(envs[i]):
                outcomes[i] = Outcome(step, "stopped")
            else:
                still.append(i)
        active = still
    for i in active:
        outcomes[i] = Outcome(envs[i].truncate(), "turn_limit")
    return [o for o in outcomes if o is not None]
