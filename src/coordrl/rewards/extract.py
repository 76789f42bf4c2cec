"""Final-answer extraction from a coordinator's conversation.

The answer format, asked for by every coordinator prompt, is one tag: ``<answer>...</answer>``.
The answer is read from the LAST message of the conversation, and only when that message is an
assistant message without tool calls. TRL can stop a rollout on an assistant turn that still holds
tool calls (turn cap, completion budget) or on a tool message; such a rollout has not answered and
scores 0, which is the honest reward for running out of turns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
# A raw tool call left in the text (e.g. unparseable JSON) still means the turn asked for a tool.
_RAW_TOOL_CALL = "<tool_call>"


def ends_with_stop(completion_ids: Sequence[int], eos_token_id: int) -> bool:
    """Whether a rollout's final turn ended with EOS. One cut off by a token cap (per turn or for the
    whole completion) has not answered, whatever its text says: it scores 0 in training
    (`coordrl.train.reward.EpisodeReward`), evaluation and inference (`coordrl.envs.step.StepEnv`)."""
    return bool(completion_ids) and completion_ids[-1] == eos_token_id


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Multimodal-style content blocks: keep the text parts.
    parts = []
    for block in content:
        if isinstance(block, Mapping) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, str):
            parts.append(block)
    return "".join(parts)


def final_answer_message(completion: str | Sequence[Mapping[str, Any]]) -> str | None:
    """Text of the message the answer is read from, or None when the rollout did not answer.

    Args:
        completion: a plain string, or a list of chat messages (dicts with ``role``, ``content`` and
            optional ``tool_calls``) as TRL passes conversational completions.
    """
    if isinstance(completion, str):
        return None if _RAW_TOOL_CALL in completion else completion
    if not completion:
        return None
    last = completion[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    text = _content_text(last.get("content"))
    return None if _RAW_TOOL_CALL in text else text


def extract_answer(completion: str | Sequence[Mapping[str, Any]]) -> str | None:
    """The text inside the last ``<answer>...</answer>`` of the final assistant message.

    Reasoning inside ``<think>...</think>`` is ignored. Returns None when the rollout ended without
    an answer message or the message holds no answer tag.
    """
    text = final_answer_message(completion)
    if text is None:
        return None
    text = _THINK_RE.sub("", text)
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    return matches[-1].strip()
