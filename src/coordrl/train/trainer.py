"""`CoordGRPOTrainer`: TRL 1.16's GRPOTrainer with two gaps closed, and nothing else changed.

TRL does the loss, tool-token masking, vLLM generation and importance-sampling correction. This
subclass overrides two internals, narrowly (``tests/test_trl_contract.py`` fails loudly if their
shape changes in a TRL release):

1. **Concurrent tools.** TRL 1.16 executes the tool calls of different rollouts one after another
   (``_tool_call_loop`` calls each rollout's tools in a Python for-loop). Here, the first tool call
   of a round triggers execution of every pending call of every rollout in that round, concurrently
   on coordrl's background event loop; TRL's loop then receives the results from a cache. Results,
   errors and their order are exactly what the serial loop would produce.
2. **Ranks in lock-step.** Ranks whose rollouts finish after different numbers of tool rounds would
   make different numbers of generation calls; with vLLM server mode, tensor-parallel colocate or
   ZeRO-3 each call holds collectives, so the ranks hang. Here every generation call inside the
   tool loop first agrees (all-reduce MAX) that some rank is still active, and a rank that is done
   joins the remaining rounds with a one-token dummy generation whose output is discarded.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOTrainer

from coordrl.envs.chat import guard_tool_call_parsing
from coordrl.readers.loop import shared_loop


class _RoundBatcher:
    """Executes a tool round for all rollouts at once; hands results to TRL's serial loop in order."""

    def __init__(
        self, completions: list[list[dict[str, Any]]], sync_dicts: list[dict], async_dicts: list[dict]
    ) -> None:
        self.completions = completions
        self.originals = [{**a, **s} for s, a in zip(sync_dicts, async_dicts, strict=True)]
        self.cache: dict[tuple[int, int], list[Any]] = {}
        self.cursor: dict[tuple[int, int], int] = {}
        self.rounds = 0
        self.max_in_flight = 0

    def wrapped_dicts(self) -> list[dict[str, Callable[..., Any]]]:
        return [{name: self._wrapper(r, name) for name in tools} for r, tools in enumerate(self.originals)]

    def _wrapper(self, rollout: int, name: str) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            key = (rollout, len(self.completions[rollout]))
            if key not in self.cache:
                self._run_round()
            results = self.cache.get(key, [])
            i = self.cursor.get(key, 0)
            self.cursor[key] = i + 1
            if i >= len(results):  # not prefetched (should not happen): run it directly, as TRL would
                result = self.originals[rollout][name](**kwargs)
                return shared_loop().run(result) if inspect.isawaitable(result) else result
            if isinstance(results[i], BaseException):
                raise results[i]
            return results[i]

        call.__name__ = name
        return call

    def _run_round(self) -> None:
        jobs: list[tuple[tuple[int, int], Callable[..., Any], Any]] = []
        for r, completion in enumerate(self.completions):
            key = (r, len(completion))
            if key in self.cache or not completion:
                continue
            last = completion[-1]
            if last.get("role") != "assistant" or not last.get("tool_calls"):
                continue
            self.cache[key] = []
            for call in last["tool_calls"]:
                # TRL only reaches the tool for function calls to known tools with mapping arguments;
                # anything else it answers itself, so it must not be executed (or counted) here.
                if call.get("type") != "function":
                    continue
                fn = call.get("function") or {}
                tool = self.originals[r].get(fn.get("name"))
                args = fn.get("arguments")
                if tool is None or not isinstance(args, dict):
                    continue
                jobs.append((key, tool, args))
        if not jobs:
            return
        self.rounds += 1
        self.max_in_flight = max(self.max_in_flight, len(jobs))

        async def run_one(tool: Callable[..., Any], args: dict[str, Any]) -> Any:
            if inspect.iscoroutinefunction(tool):
                return await tool(**args)
            result = await asyncio.to_thread(tool, **args)
            return await result if inspect.isawaitable(result) else result

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(run_one(t, a) for _, t, a in jobs), return_exceptions=True)

        results = shared_loop().run(run_all())
        for (key, _, _), result in zip(jobs, results, strict=True):
            self.cache[key].append(result)


class CoordGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with concurrent tool rounds and lock-step ranks (see module docstring).

    Args:
        tool_concurrency: run each round's tool calls for all rollouts concurrently (default True).
        lockstep: keep ranks in step through the tool loop when more than one process runs (default True).
        mask_observations: keep tool-response tokens out of the loss, as TRL does (default True). False is
            an ablation only: the policy is then also trained on text it did not generate.
        Everything else goes to ``trl.GRPOTrainer``.
    """

    def __init__(
        self,
        *args: Any,
        tool_concurrency: bool = True,
        lockstep: bool = True,
        mask_observations: bool = True,
        **kwargs: Any,
    ) -> None:
        self.tool_concurrency = tool_concurrency
        self.lockstep = lockstep
        self.mask_observations = mask_observations
        self._in_tool_loop = False
        self._joining = False
        self.tool_loop_stats = {"batched_rounds": 0, "max_parallel_calls": 0, "generation_rounds": 0, "dummy_rounds": 0}
        super().__init__(*args, **kwargs)
        # TRL's turn parser lets RecursionError through: a policy that nests its tool-call JSON ~1,000
        # deep would end the run. Refused as a malformed call instead (see guard_tool_call_parsing).
        guard_tool_call_parsing(self._tokenizer)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.mask_observations:
            # TRL multiplies the completion mask by ``tool_mask`` only when the key is present.
            out.pop("tool_mask", None)
        return out

    # -- 1. concurrent tools ------------------------------------------------------------------------

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        batcher = None
        saved = (self._sync_tool_dicts, self._async_tool_dicts)
        if self.tool_concurrency:
            batcher = _RoundBatcher(completions, self._sync_tool_dicts, self._async_tool_dicts)
            self._sync_tool_dicts = batcher.wrapped_dicts()
            self._async_tool_dicts = [{} for _ in self._sync_tool_dicts]
        self._in_tool_loop = True
        try:
            result = super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
        finally:
            self._in_tool_loop = False
            self._sync_tool_dicts, self._async_tool_dicts = saved
        if batcher is not None:
            self.tool_loop_stats["batched_rounds"] += batcher.rounds
            self.tool_loop_stats["max_parallel_calls"] = max(
                self.tool_loop_stats["max_parallel_calls"], batcher.max_in_flight
            )
        self._join_remaining_rounds(prompt_ids)
        return result

    # -- 2. lock-step ranks -------------------------------------------------------------------------

    def _lockstep_on(self) -> bool:
        return self.lockstep and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _any_rank_active(self, active: bool) -> bool:
        flag = torch.tensor([1 if active else 0], device=self.accelerator.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # The flag exchange precedes the generator's own collectives on every rank, active or joining.
        if self._in_tool_loop and not self._joining:
            self.tool_loop_stats["generation_rounds"] += 1
            if self._lockstep_on():
                self._any_rank_active(True)
        return self._backend_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _backend_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generator (vLLM or transformers); the one seam tests replace with scripted ids."""
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _join_remaining_rounds(self, prompt_ids) -> None:
        if not self._lockstep_on():
            return
        dummy = [list(prompt_ids[0][:1]) if prompt_ids and prompt_ids[0] else [self.processing_class.eos_token_id]]
        while self._any_rank_active(False):
            self._joining = True
            try:
                self._generate_single_turn(dummy, None, {}, num_generations=1)
            finally:
                self._joining = False
            self.tool_loop_stats["dummy_rounds"] += 1
