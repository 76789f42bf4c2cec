"""Policies that act in a `StepEnv`: a scripted baseline and a Hugging Face model run in-process.

A policy maps the ids the environment has built so far to the ids of its next assistant turn, or
returns text (the scripted baseline). Either way the environment parses it with TRL's parser.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from coordrl.envs.step import StepEnv
from coordrl.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN


class Policy(Protocol):
    def act(self, env: StepEnv) -> str | list[int]: ...


_FINDING = re.compile(r"^- chunk \d+: (.*)$", re.MULTILINE)


class ScriptedLead:
    """Model-free baseline for checking the plumbing: broadcast the question once, then answer with
    the first finding (or "unknown"). It scores near zero on exact match by design."""

    name = "scripted"

    def act(self, env: StepEnv) -> str:
        if env.tool_rounds == 0:
            question = env.messages[-1]["content"].removeprefix("Question: ")
            import json

            call = json.dumps({"name": "query_agents", "arguments": {"queries": [question]}}, ensure_ascii=False)
            return f"<tool_call>\n{call}\n</tool_call>"
        last = str(env.messages[-1].get("content", ""))
        found = _FINDING.search(last)
        answer = found.group(1).split(": ", 1)[-1] if found else "unknown"
        return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


class HFPolicy:
    """A causal LM from a local folder, generating on CPU or GPU with transformers.

    Args:
        path: model folder (safetensors weights only; ``use_safetensors=True`` is enforced).
        max_new_tokens: tokens per assistant turn (default 256).
        temperature: 0 for greedy decoding (default), else sampling with ``top_p``.
        seed: torch seed for sampling.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        device: str | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, use_safetensors=True, dtype=torch.float32)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.generator_seed = seed
        torch.manual_seed(seed)
        self.name = f"hf:{Path(self.path).name}"

    def act(self, env: StepEnv) -> list[int]:
        import torch

        ids: Sequence[int] = env.context_ids
        budget = self.max_new_tokens
        if env.max_completion_tokens is not None:
            budget = min(budget, env.max_completion_tokens - len(env.completion_ids))
        if budget <= 0:
            return []
        inputs = torch.tensor([list(ids)], device=self.device)
        sampling = (
            {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}
            if self.temperature > 0
            else {"do_sample": False}
        )
        with torch.no_grad():
            out = self.model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=budget,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                **sampling,
            )
        return out[0, inputs.shape[1] :].tolist()
