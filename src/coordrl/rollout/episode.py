"""Running whole episodes: the loop shared by `coordrl rollout`, evaluation and inference."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from coordrl.envs.step import StepEnv, play
from coordrl.rewards import extract_answer
from coordrl.rollout.policies import Policy


@dataclass
class Episode:
    """A finished episode: the conversation, the findings, the reward and the metrics."""

    sample_id: str
    question: str
    answers: list[str]
    prediction: str | None
    reward: float
    terminated: bool
    messages: list[dict[str, Any]]
    findings: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.sample_id,
            "question": self.question,
            "answers": self.answers,
            "prediction": self.prediction,
            "reward": self.reward,
            "terminated": self.terminated,
            "seconds": round(self.seconds, 3),
            "info": self.info,
            "findings": self.findings,
            "messages": self.messages,
        }


def run_episode(env: StepEnv, policy: Policy, row: dict[str, Any], max_assistant_turns: int | None = None) -> Episode:
    """Play one episode of ``policy`` on ``row`` (synchronously) through the shared loop, `play`."""
    t0 = time.perf_counter()
    env.reset(**row)
    limit = max_assistant_turns or env.max_turns + 1
    (outcome,) = play([env], lambda envs: [policy.act(envs[0])], limit)
    step = outcome.step
    answers = row.get("answers") if row.get("answers") is not None else [row.get("answer", "")]
    return Episode(
        sample_id=str(row.get("id", "")),
        question=row.get("question", ""),
        answers=list(answers),
        prediction=None if env.cut_off else extract_answer(env.completion),
        reward=step.reward,
        terminated=step.terminated,
        messages=env.messages,
        findings=list(getattr(env.env, "findings", [])),
        info=step.info,
        seconds=time.perf_counter() - t0,
    )


def format_episode(ep: Episode, max_chars: int = 600) -> str:
    """Human-readable episode: conversation (system prompt elided), findings count, reward, info."""
    lines = [f"sample {ep.sample_id}: {ep.question}", f"gold: {ep.answers}", ""]
    for m in ep.messages:
        role = m.get("role")
        if role == "system":
            lines.append("[system] (lead-agent protocol prompt)")
            continue
        content = str(m.get("content") or "")
        if len(content) > max_chars:
            content = content[:max_chars] + f" [... {len(content) - max_chars} more characters]"
        if m.get("tool_calls"):
            for call in m["tool_calls"]:
                content += f"\n  -> {call['function']['name']}({call['function']['arguments']})"
        lines.append(f"[{role}] {content}".rstrip())
    lines += [
        "",
        f"prediction: {ep.prediction!r}   reward: {ep.reward}   {'answered' if ep.terminated else 'no answer (truncated)'}",
    ]
    info = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in ep.info.items())
    lines.append(f"info: {info}")
    return "\n".join(lines)
