"""Training rewards in TRL's reward-function form.

TRL calls ``reward_func(prompts=..., completions=..., completion_ids=..., **columns)`` where each
dataset column arrives as a list with one entry per completion. coordrl datasets carry ``answers``
(a list of gold strings per sample); the HotpotQA-style ``answer`` (one string) also works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from coordrl.rewards.extract import extract_answer
from coordrl.rewards.metrics import exact_match, f1_score


def _golds_per_completion(n: int, answers: Sequence[Any] | None, answer: Sequence[Any] | None) -> list[list[str]]:
    column = answers if answers is not None else answer
    if column is None:
        raise ValueError("reward needs an 'answers' (list of strings) or 'answer' dataset column")
    if len(column) != n:
        raise ValueError(f"reward got {n} completions but {len(column)} gold entries")
    return [[g] if isinstance(g, str) else list(g) for g in column]


def _make_reward(metric: Callable[[str | None, Sequence[str]], float], name: str) -> Callable[..., list[float]]:
    def reward(
        completions: Sequence[Any],
        answers: Sequence[Any] | None = None,
        answer: Sequence[Any] | None = None,
        **_: Any,
    ) -> list[float]:
        golds = _golds_per_completion(len(completions), answers, answer)
        return [metric(extract_answer(c), g) for c, g in zip(completions, golds, strict=True)]

    reward.__name__ = name
    reward.__doc__ = f"Per-completion {name.replace('_reward', '')} of the tagged final answer (0 when absent)."
    return reward


exact_match_reward = _make_reward(exact_match, "exact_match_reward")
f1_reward = _make_reward(f1_score, "f1_reward")
