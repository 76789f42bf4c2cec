"""The baselines ``coordrl eval --baseline`` runs in the same harness as a trained policy.

- ``prompted``: the untrained base model with the trained policy's prompt and settings (for a
  checkpoint or export: its recorded ``base_model``). Equivalent to ``--policy <base model>``.
- ``mapreduce``: one round. A scripted first turn broadcasts the question to all readers with
  ``query_agents([question])``; the model then answers from the findings in one generation (a tool
  call in that generation ends the episode unanswered): `MapReducePolicy`.
- ``fullcontext``: no readers; the whole document in one prompt, middle-truncated to fit the model's
  window (``--context-window``, default the model's ``max_position_embeddings`` or the server's
  ``max_model_len``); the cut token counts are reported: `FullContextEnv`, `fullcontext_messages`.
"""

from __future__ import annotations

from typing import Any

from coordrl.data.errors import DataError
from coordrl.rewards import ANSWER_CLOSE, ANSWER_OPEN
from coordrl.rollout.policies import ScriptedLead

__all__ = ["BASELINES", "FULLCONTEXT_SYSTEM_PROMPT", "FullContextEnv", "MapReducePolicy", "fullcontext_messages"]

BASELINES = ("prompted", "mapreduce", "fullcontext")

FULLCONTEXT_SYSTEM_PROMPT = (
    "You answer questions about a document. Read the document, then reply with the answer inside "
    f"{ANSWER_OPEN}{ANSWER_CLOSE} and nothing else after it, for example {ANSWER_OPEN}Paris{ANSWER_CLOSE}. "
    "Give the shortest answer: a name, a date, a number, or yes/no."
)
_CUT_MARKER = "\n\n[... {cut} tokens cut from the middle of the document ...]\n\n"


class MapReducePolicy:
    """``mapreduce`` baseline: the scripted lead's broadcast of the question, then one model generation."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.first = ScriptedLead()  # its first turn is exactly query_agents([question])

    def act(self, env):
        if not env.completion:
            return self.first.act(env)
        return self.inner.act(env)


class FullContextEnv:
    """``fullcontext`` baseline environment: no tools, no readers; StepEnv renders the prompt."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def reset(self, **row: Any) -> None:
        return None

    @property
    def info(self) -> dict[str, Any]:
        return {"turns": 0, "queries": 0, "queries_per_turn": 0.0, "reader_calls": 0, **self.stats}

    @property
    def findings(self) -> list[dict[str, Any]]:
        return []


def fullcontext_messages(
    row: dict[str, Any], codec, window: int, max_new_tokens: int
) -> tuple[list[dict[str, str]], dict[str, int]]:
    """The full-context prompt of ``row``, middle-truncated so prompt + ``max_new_tokens`` fit ``window``.

    Returns the messages and ``{document_tokens, cut_tokens}``. The head and tail of the document
    are kept (token-aligned, cut at character offsets so no character is split) around a marker that
    says how many tokens were cut.
    """
    tokenizer = codec.tokenizer
    question = row["question"]
    document = row["context"]

    def messages(doc: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": FULLCONTEXT_SYSTEM_PROMPT},
            {"role": "user", "content": f"{doc}\n\nQuestion: {question}"},
        ]

    enc = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    n = len(offsets)
    overhead = len(codec.prompt_ids(messages(_CUT_MARKER.format(cut=n)), None))
    budget = window - max_new_tokens - overhead
    if budget < 16:
        raise DataError(
            f"context window {window} leaves no room for the document (prompt overhead {overhead}, {max_new_tokens} new tokens)"
        )
    if n <= budget:
        return messages(document), {"document_tokens": n, "cut_tokens": 0}
    for _ in range(4):  # re-tokenization at the seams can add a token or two: shrink and retry
        head = budget // 2
        tail = budget - head
        cut = n - head - tail
        text = document[: offsets[head - 1][1]] + _CUT_MARKER.format(cut=cut) + document[offsets[n - tail][0] :]
        msgs = messages(text)
        total = len(codec.prompt_ids(msgs, None)) + max_new_tokens
        if total <= window:
            return msgs, {"document_tokens": n, "cut_tokens": cut}
        budget -= total - window + 8
    raise DataError(f"could not fit sample {row.get('id')!r} into a {window}-token window")
