"""`CoordGRPOTrainer`: TRL 1.16's GRPOTrainer with four gaps closed, and nothing else changed.

TRL does the loss, tool-token masking, vLLM generation and importance-sampling correction. This
subclass overrides three internals, narrowly (``tests/test_trl_contract.py`` fails loudly if their
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
3. **Shared prompt prefix** (opt-in, ``share_prompt_prefix``). TRL scores every rollout as its own
   sequence, so the prompt a group's ``num_generations`` rollouts share is forwarded and
   back-propagated once per rollout. Here each distinct prompt is forwarded once, its KV cache is
   repeated over the group's rows, and only the completions are forwarded per row (see
   `CoordGRPOTrainer._get_per_token_logps_and_entropies`).
4. **Shared generation prefix** (opt-in, ``share_generation_prefix``). With transformers generation
   (no vLLM), every generation call of the tool loop left-pads its rows and prefills each whole, though
   they all start with the same system prompt and tool schema, and a question's rollouts with the same
   prompt. Here the prefix all rows share and each group's shared prompt are forwarded once, and their KV
   cache starts every row's generation (see `_generate_from_common_prefix`). No further TRL
   internal is overridden: while TRL's transformers path runs, the model's ``generate`` is wrapped, and
   ``tests/test_shared_prefix.py`` fails if a real GRPO step stops reaching the wrapper.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache
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
        share_prompt_prefix: forward each distinct prompt once per scoring pass instead of once per
            rollout (default False; see `_get_per_token_logps_and_entropies`).
        share_generation_prefix: in transformers generation, forward the prefix common to every row of a
            generation call once instead of once per row (default False; see `_generate_from_common_prefix`).
        Everything else goes to ``trl.GRPOTrainer``.
    """

    def __init__(
        self,
        *args: Any,
        tool_concurrency: bool = True,
        lockstep: bool = True,
        mask_observations: bool = True,
        share_prompt_prefix: bool = False,
        share_generation_prefix: bool = False,
        **kwargs: Any,
    ) -> None:
        self.tool_concurrency = tool_concurrency
        self.lockstep = lockstep
        self.mask_observations = mask_observations
        self.share_prompt_prefix = share_prompt_prefix
        self.share_generation_prefix = share_generation_prefix
        self.prefix_stats = new_prefix_stats()
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
        shared = (
            self.share_generation_prefix
            and not self.use_vllm
            and not self.use_transformers_continuous_batching
            and not self._is_vlm
            and not images
            and not multimodal_fields
            and self.generation_config.cache_implementation is None
        )
        model = self.accelerator.unwrap_model(self.model)
        with _common_prefix_generate(model, self.prefix_stats) if shared else contextlib.nullcontext():
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )

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

    # -- 3. shared prompt prefix ----------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """Per-token log-probs (and entropies) of the completions, as TRL computes them, with each distinct
        prompt forwarded once.

        ``input_ids`` and ``attention_mask`` are ``(B, P + C)``: the left-padded prompts, then the
        completions (``C = logits_to_keep``). Rows whose prompt tokens and mask are equal form a group
        (the ``num_generations`` rollouts of one prompt). For each group the first ``P - 1`` prompt
        tokens are forwarded once, with gradient, into a KV cache; the cache is repeated over the
        group's rows and the last prompt token with the completion (``C + 1`` tokens per row) is
        forwarded on top of it through TRL's fused LM head. Positions, masks and labels are the plain
        pass's, so the result equals it within float rounding (GEMMs of other shapes); gradients reach
        the prompt's activations through the repeated cache. Returns ``(logps, entropies, None)``,
        ``(B, C)`` each, rows in input order.

        Cost: ``G (P - 1) + B (C + 1)`` tokens forwarded and back-propagated instead of ``B (P + C)``.
        The HMARS world (B 16 rollouts of G 2 prompts, P 1,284, C 216 padded): 24,000 -> 6,038 tokens,
        and the pass (forward + backward) 5.6x faster on 2 CPU cores, attention's quadratic share
        shrinking too (`benchmarks/shared_prefix.py`). An H100 HMARS run on real documents (regional memory ~3,000 prompt tokens,
        ~600 completion tokens, 8 generations per prompt): 8 x 3,600 = 28,800 -> 3,000 + 4,800 = 7,800,
        3.7x, before attention's quadratic share. Falls back to TRL's pass (identical by construction)
        when nothing is shared, for multimodal or MoE aux-loss inputs, and under gradient
        checkpointing (recomputed layers would append to the cache twice).
        """
        unwrapped = self.accelerator.unwrap_model(model)
        plain = (
            not self.share_prompt_prefix
            or kwargs.get("compute_aux_loss")
            or any(v is not None for k, v in kwargs.items() if k != "compute_aux_loss")
            or _checkpointing(unwrapped)
        )
        split = input_ids.size(1) - logits_to_keep - 1  # prompt tokens that go into the shared cache
        groups = (
            None if plain or split < 1 else _prompt_groups(input_ids[:, : split + 1], attention_mask[:, : split + 1])
        )
        if groups is None or len(groups) == input_ids.size(0):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
            )
        chunk = batch_size or input_ids.size(0)
        cache_kwarg = _cache_kwarg(unwrapped)
        rows, logps, entropies = [], [], []
        for group in groups:
            head = group[:1]
            with self.accelerator.autocast():
                prefix = model(
                    input_ids=input_ids[head, :split],
                    attention_mask=attention_mask[head, :split],
                    use_cache=True,
                    logits_to_keep=1,
                )
            layers = _cache_of(prefix).layers
            for start in range(0, len(group), chunk):
                part = group[start : start + chunk]
                cache = DynamicCache()
                for i, layer in enumerate(layers):
                    cache.update(
                        layer.keys.expand(len(part), -1, -1, -1), layer.values.expand(len(part), -1, -1, -1), i
                    )
                tail = input_ids[part, split:]
                labels = tail[:, 1:].masked_fill(attention_mask[part, split + 1 :] == 0, -100)
                shift_labels = torch.cat([labels, labels.new_full((len(part), 1), -100)], dim=1)
                with self.accelerator.autocast():
                    out = model(
                        input_ids=tail,
                        attention_mask=attention_mask[part],
                        shift_labels=shift_labels,
                        fused_lm_head=True,
                        **{cache_kwarg: cache},
                    )
                rows.append(part)
                logps.append(out.log_probs[:, :logits_to_keep])
                if compute_entropy:
                    entropies.append(out.entropy[:, :logits_to_keep])
        order = torch.argsort(torch.cat(rows))
        self.prefix_stats["shared_calls"] += 1
        self.prefix_stats["tokens_forwarded"] += len(groups) * split + input_ids.size(0) * (logits_to_keep + 1)
        self.prefix_stats["tokens_plain"] += input_ids.numel()
        return torch.cat(logps)[order], torch.cat(entropies)[order] if compute_entropy else None, None


def new_prefix_stats() -> dict[str, int]:
    """Counters of the shared-prefix passes. Scoring: calls that shared, tokens forwarded, tokens TRL's pass
    would forward. Generation: calls that started from a common prefix, tokens prefilled, tokens TRL's
    left-padded prefill would forward."""
    return {
        "shared_calls": 0,
        "tokens_forwarded": 0,
        "tokens_plain": 0,
        "generation_calls": 0,
        "generation_prefill": 0,
        "generation_prefill_plain": 0,
    }


# Below this many common tokens a generation call prefills as TRL does: the saving would not pay for the
# extra forward.
MIN_COMMON_PREFIX = 16


@contextlib.contextmanager
def _common_prefix_generate(model, stats: dict[str, int]):
    """While open, ``model.generate`` starts from the prefix its rows share (`_generate_from_common_prefix`)."""
    plain = model.generate
    own = model.__dict__.get("generate")

    def generate(*args: Any, **kwargs: Any):
        return _generate_from_common_prefix(model, plain, stats, *args, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


def _generate_from_common_prefix(model, plain: Callable[..., Any], stats: dict[str, int], *args: Any, **kwargs: Any):
    """``plain(input_ids=..., attention_mask=..., **rest)`` with the prefixes its rows share forwarded once.

    ``input_ids`` and ``attention_mask`` are ``(B, T)``, left-padded as TRL pads them. Two levels of
    sharing:

    - every row's real tokens start with the same ``L`` tokens (the system prompt and tool schema):
      forwarded once, batch 1;
    - past them, rows fall into groups that share ``G_g`` more tokens (a question's prompt: GRPO repeats
      it over ``num_generations`` rows, and tool rounds only append to it; `_row_groups`): each group's
      segment is forwarded once, batch ``U`` (the number of groups), on the common prefix's cache.

    The cache is then repeated over the rows and generation prefills only what is left of each row. Row
    layout: the common prefix, padding, the group's segment, padding, the row's rest; the attention mask
    hides the padding and generation derives positions from it, so every token keeps the position and
    context it has in the left-padded batch: the same computation up to float rounding (GEMMs of other
    shapes), and greedy decoding gives the same tokens (tested). Output: as ``plain`` returns it, the
    rows' original ``(B, T)`` prompt ids followed by their completions.

    Cost: ``L + sum_g G_g + sum_i (n_i - L - G_(g_i))`` prefill tokens instead of ``B T``. The PARSER
    world's calls (16 rows, about 450 common tokens of 470-900): 2.5-8x fewer; the HMARS world's first
    call (16 rows of two 1,270-token prompts): about 20,000 -> 2,000.

    Anything else (positional arguments, a cache, other inputs, fewer than `MIN_COMMON_PREFIX` common
    tokens) goes to ``plain`` unchanged.
    """
    input_ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    extra = set(kwargs) - {"input_ids", "attention_mask", "generation_config"}
    if args or extra or input_ids is None or mask is None or input_ids.dim() != 2:
        return plain(*args, **kwargs)
    rows = [ids[m.bool()] for ids, m in zip(input_ids, mask, strict=True)]
    common = min(len(r) for r in rows) - 1  # every row keeps a token to prefill
    for row in rows[1:]:
        common = _shared_len(row, rows[0], common)
    if common < MIN_COMMON_PREFIX:
        return plain(*args, **kwargs)
    tails = [r[common:] for r in rows]
    groups, seg = _row_groups(tails)
    batch, n_groups = len(rows), len(groups)
    seg_width = max(seg)
    rest_width = max(len(tails[i]) - seg[g] for g, members in enumerate(groups) for i in members)
    width = common + seg_width + rest_width
    ids = torch.zeros((batch, width), dtype=input_ids.dtype, device=input_ids.device)
    layout = torch.zeros((batch, width), dtype=mask.dtype, device=mask.device)
    row_group = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
    prefill = common + sum(seg)
    for g, members in enumerate(groups):
        n = seg[g]
        for i in members:
            tail = tails[i]
            segment, own = slice(common + seg_width - n, common + seg_width), slice(width - (len(tail) - n), None)
            ids[i] = input_ids[i, 0]  # the row's own pad value, hidden by the mask
            ids[i, :common], ids[i, segment], ids[i, own] = rows[i][:common], tail[:n], tail[n:]
            layout[i, :common] = layout[i, segment] = layout[i, own] = 1
            row_group[i] = g
            prefill += len(tail) - n
    cache_kwarg = _cache_kwarg(model)
    with torch.no_grad():
        prefix = model(input_ids=rows[0][None, :common], use_cache=True, logits_to_keep=1)
        cache = DynamicCache()
        for i, layer in enumerate(_cache_of(prefix).layers):
            cache.update(layer.keys.expand(n_groups, -1, -1, -1), layer.values.expand(n_groups, -1, -1, -1), i)
        if seg_width:
            firsts = [members[0] for members in groups]
            seg_mask = layout[firsts, : common + seg_width]
            positions = (seg_mask.cumsum(-1) - 1).clamp(min=0)[:, common:]
            model(
                input_ids=ids[firsts, common : common + seg_width],
                attention_mask=seg_mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg: cache},
            )
        rows_cache = DynamicCache()
        for i, layer in enumerate(cache.layers):
            rows_cache.update(layer.keys.index_select(0, row_group), layer.values.index_select(0, row_group), i)
    stats["generation_calls"] += 1
    stats["generation_prefill"] += prefill
    stats["generation_prefill_plain"] += input_ids.numel()
    rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
    out = plain(input_ids=ids, attention_mask=layout, **rest, **{cache_kwarg: rows_cache})
    # Callers slice completions after the prompt width they passed, so the original prompt goes back in.
    if isinstance(out, torch.Tensor):
        return torch.cat([input_ids, out[:, width:]], dim=1)
    out.sequences = torch.cat([input_ids, out.sequences[:, width:]], dim=1)
    return out


def _shared_len(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = min(limit, len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def _row_groups(tails: list[torch.Tensor]) -> tuple[list[list[int]], list[int]]:
    """Rows grouped by a shared start of at least `MIN_COMMON_PREFIX` tokens, and each group's segment
    length (the tokens all its rows share; every row keeps at least one token after it).

    A row joins the group whose first row it shares most with; a row alone in its group puts all but its
    last token in the segment (forwarded once either way)."""
    groups: list[list[int]] = []
    seg: list[int] = []
    for i, tail in enumerate(tails):
        best, best_len = None, 0
        for g, members in enumerate(groups):
            n = _shared_len(tail, tails[members[0]], min(seg[g], len(tail) - 1))
            if n > best_len:
                best, best_len = g, n
        if best is not None and best_len >= MIN_COMMON_PREFIX:
            groups[best].append(i)
            seg[best] = best_len
        else:
            groups.append([i])
            seg.append(len(tail) - 1)
    return groups, seg


def _cache_kwarg(model) -> str:
    """The backbone forward's name for a KV cache: transformers renamed ``past_key_values`` to ``cache``
    (the old name warns until 5.40)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes kwargs through
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _checkpointing(model) -> bool:
    # transformers 5.2x renamed the flag; reading the old name warns.
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def _cache_of(output) -> DynamicCache:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[torch.Tensor]:
    """Row indices grouped by equal prompt (tokens where the mask is 1, and the mask itself), in order
    of first appearance."""
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    firsts: dict[int, list[int]] = {}
    for row, g in enumerate(inverse.tolist()):
        firsts.setdefault(g, []).append(row)
    return [torch.tensor(rows, device=prompt_ids.device) for rows in firsts.values()]
