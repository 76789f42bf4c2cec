"""Test doubles for tests and benchmarks, named as such. They replace only what a CPU machine cannot
provide on demand: a policy that makes tool calls on cue (a random tiny model rarely does) and a
reader with a chosen latency. The trainer's tool loop, the environment, masking and the loss stay real.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence

from coordrl.readers.base import ReaderFleet, ReaderRequest, ReaderResult
from coordrl.readers.lexical import LexicalReader


def scripted_trainer_class(
    base: type, rounds: int | Callable[[int], int], query: str = "Who directed the film?", call: dict | None = None
) -> type:
    """A trainer class whose generator is scripted: each rollout makes ``rounds`` tool calls
    (``rounds(rank)`` when callable, so ranks can differ), then answers ``<answer>unknown</answer>``.
    The call is ``query_agents`` with ``query``, or ``call`` (``{"name": ..., "arguments": ...}``) when given.

    Only the generator seam ``_backend_generate`` is replaced (a generation test double); TRL's tool loop,
    parsing, masking, rewards and loss run unchanged on the returned ids.
    """

    class ScriptedGenerationTrainer(base):
        def _scripted_ids(self, prompt: Sequence[int]) -> list[int]:
            tok = self.processing_class
            marker = tok.convert_tokens_to_ids("<tool_response>")
            done = sum(1 for t in prompt if t == marker)
            want = rounds(int(os.environ.get("RANK", "0"))) if callable(rounds) else rounds
            if done < want:
                body = call or {"name": "query_agents", "arguments": {"queries": [f"{query} (round {done + 1})"]}}
                text = f"<tool_call>\n{json.dumps(body)}\n</tool_call>"
            else:
                text = "<answer>unknown</answer>"
            return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

        def _backend_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            if getattr(self, "_joining", False):  # a lock-step filler round: output is discarded
                return [[self.processing_class.eos_token_id] for _ in prompt_ids], None
            return [self._scripted_ids(ids) for ids in prompt_ids], None

    ScriptedGenerationTrainer.__name__ = f"Scripted{base.__name__}"
    return ScriptedGenerationTrainer


class LatencyInjectingFleet:
    """Fake reader fleet that adds ``delay_s`` to every batch of requests, then answers with an
    inner fleet (lexical by default). Records how many batches were in flight at once."""

    def __init__(self, delay_s: float, inner: ReaderFleet | None = None) -> None:
        self.delay_s = delay_s
        self.inner = inner or LexicalReader()
        self.in_flight = 0
        self.max_in_flight = 0
        self.batches = 0

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]:
        self.in_flight += 1
        self.batches += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        t0 = time.perf_counter()
        try:
            await asyncio.sleep(self.delay_s)
            results = await self.inner.answer(requests)
        finally:
            self.in_flight -= 1
        dt = time.perf_counter() - t0
        return [ReaderResult(r.text, r.ok, r.error, dt, r.attempts) for r in results]

    async def aclose(self) -> None:
        await self.inner.aclose()
