"""The training reward: exact match of the tagged answer, plus environment metrics and traces.

TRL hands every reward function the local rollouts' environments and a ``log_metric`` hook, so the
episode metrics (turns, queries per turn, reader calls, abstain rate, latency, tool failures, gold
coverage) and the JSONL traces are produced here, next to the reward they explain.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordrl.rewards import ends_with_stop, exact_match_reward, extract_answer


class EpisodeReward:
    """TRL reward function: binary EM; logs ``env/<metric>`` means and writes traces.

    Args:
        trace_dir: folder for ``rank<k>.jsonl`` traces (None: no traces).
        rank: this process's rank (one trace file per rank, no cross-process writes).
        score: False where the environment owns the reward (HMARS): only metrics and traces.
        eos_token_id: when given, a rollout whose last token is not EOS (its final turn was cut off by
            the per-turn or the completion token cap) scores 0 whatever its text, as
            `coordrl.envs.step.StepEnv` scores it in evaluation and inference. Without this an answer
            followed by tokens up to the cap scores like a finished one, and GRPO reinforces the
            run-on text (measured on the world: the stop token after ``</answer>`` fell from ~1.0 to
            ~0.0 probability in 140 steps). Logged as ``env/unfinished``.
    """

    __name__ = "exact_match"

    def __init__(
        self, trace_dir: str | Path | None = None, rank: int = 0, score: bool = True, eos_token_id: int | None = None
    ) -> None:
        self.eos_token_id = eos_token_id
        # score=False: the environment owns the reward (TRL adds its get_reward column); this
        # function then only logs metrics and traces and returns None (ignored by TRL's nansum).
        self.score = score
        self.trace_path = Path(trace_dir) / f"rank{rank}.jsonl" if trace_dir else None
        if self.trace_path is not None:
            self.trace_path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(
        self,
        completions: Sequence[Any],
        answers: Sequence[Any] | None = None,
        environments: Sequence[Any] | None = None,
        trainer_state: Any = None,
        log_metric: Any = None,
        **columns: Any,
    ) -> list[float | None]:
        token_ids = columns.get("completion_ids")  # TRL passes each rollout's completion ids
        check = self.eos_token_id is not None and token_ids is not None
        unfinished = [check and not ends_with_stop(token_ids[i], self.eos_token_id) for i in range(len(completions))]
        if self.score:
            rewards = exact_match_reward(completions, answers=answers, answer=columns.get("answer"))
            rewards = [0.0 if cut else r for r, cut in zip(rewards, unfinished, strict=True)]
        else:
            rewards = (
                [e.get_reward() if hasattr(e, "get_reward") else None for e in environments]
                if environments
                else [None] * len(completions)
            )
        infos = [dict(getattr(e, "info", {}) or {}) for e in environments] if environments else []
        if log_metric is not None and check:
            log_metric("env/unfinished", sum(unfinished) / max(1, len(unfinished)))
        if log_metric is not None and infos:
            sums: dict[str, list[float]] = defaultdict(list)
            for info in infos:
                for k, v in info.items():
                    if isinstance(v, (int, float)):
                        sums[k].append(float(v))
            for k, values in sums.items():
                log_metric(f"env/{k}", sum(values) / len(values))
        if self.trace_path is not None:
            step = getattr(trainer_state, "global_step", None)
            ids = columns.get("id") or [None] * len(completions)
            questions = columns.get("question") or [None] * len(completions)
            golds = answers if answers is not None else columns.get("answer") or [None] * len(completions)
            # A policy's tool-call JSON can spell a lone surrogate ("\ud800"), which UTF-8 cannot
            # encode; backslashreplace writes it as that same JSON escape, so the line stays valid JSON.
            with open(self.trace_path, "a", encoding="utf-8", errors="backslashreplace") as fh:
                for i, completion in enumerate(completions):
                    env = environments[i] if environments else None
                    fh.write(
                        json.dumps(
                            {
                                "step": step,
                                "pid": os.getpid(),
                                "id": ids[i],
                                "question": questions[i],
                                "answers": golds[i],
                                "prediction": None if unfinished[i] else extract_answer(completion),
                                "reward": rewards[i],
                                "info": infos[i] if infos else {},
                                "findings": getattr(env, "findings", []),
                                "completion": completion,
                            },
                            ensure_ascii=False,
                            default=str,
                        )
                        + "\n"
                    )
        return rewards if self.score else [None] * len(completions)
