"""The HMARS mid-agent environment: one broadcast, full fan-out page selection, one frozen answer.

One instance per rollout, in the shape TRL's ``environment_factory`` expects. ``reset(**row)``
loads (or builds and caches) the row's index (`coordrl.envs.hmars_index`), binds ONE mid-agent
region and returns that region's memory as text, which TRL appends to the last user message. The
only tool is ``broadcast(interpretation, hints)``: every sub-agent of the region then selects pages
in parallel with the selector backend, the selected pages are deduplicated and ordered by offset,
and the answer backend answers from them. ``get_reward()`` owns the reward (TRL calls it).

Region binding, by design: training samples are sized to one mid-agent (``c_sub * group_size``
tokens or fewer: at the training defaults below every ~28K-token sample is a single region), so
``reset`` binds group 0. A longer document still trains on group 0 only (``info["regions"]``
shows it; ``gold_in_region`` says whether the gold evidence was reachable). At inference,
`answer_all_regions` runs all K mid-agents concurrently with the same policy and answers once from
the merged evidence.

The episode is a plain object (`coordrl.envs.hmars_episode.MidAgentEpisode`); `MidAgentEnv` adapts
it to TRL with ``reset``, ``broadcast`` and ``get_reward`` and properties only, because TRL turns
every public method into a tool. Settings live in `coordrl.envs.hmars_config`, the frozen roles
in `coordrl.envs.hmars_roles`.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from coordrl.data.tokens import load_tokenizer
from coordrl.envs.hmars_config import MODES, ROLE_ERROR_KEYS, HmarsEnvConfig
from coordrl.envs.hmars_episode import EpisodeStats, MidAgentEpisode
from coordrl.envs.hmars_index import DocumentIndex, IndexCache
from coordrl.envs.hmars_prompts import hmars_prompt
from coordrl.envs.hmars_roles import Backends
from coordrl.envs.step import StepEnv, play
from coordrl.envs.tool_input import tool_call_too_deep
from coordrl.readers.loop import shared_loop

__all__ = [
    "MODES",
    "ROLE_ERROR_KEYS",
    "HmarsEnvConfig",
    "HmarsEnvFactory",
    "MidAgentEnv",
    "MultiRegionResult",
    "answer_all_regions",
    "parse_broadcast",
]


class MidAgentEnv:
    """The TRL environment of one HMARS mid-agent rollout: an adapter over `MidAgentEpisode`.
    Build through `HmarsEnvFactory` so instances share backends, tokenizer and index cache.

    ``reset(**row)`` takes a dataset row with ``question``, ``answers`` (or ``answer``),
    ``gold_documents``, ``context`` and ``doc_offsets``; it binds region ``region`` (training: 0).
    With ``answers=False`` a broadcast stops after page selection: multi-region inference answers
    once, from every region's pages.
    """

    def __init__(
        self,
        config: HmarsEnvConfig,
        backends: Backends,
        tokenizer,
        index_cache: IndexCache,
        *,
        region: int = 0,
        answers: bool = True,
    ) -> None:
        self._episode = MidAgentEpisode(config, backends, tokenizer, index_cache)
        self._region = region
        self._answers = answers

    def reset(self, **row: Any) -> str:
        """Bind a sample and its region; returns the regional memory (TRL appends it to the prompt).

        Raises ValueError naming the field when the row cannot be used.
        """
        self._episode.start(row)
        return "\n\n" + self._episode.bind_region(self._region)

    async def broadcast(self, interpretation: str, hints: dict[str, str]) -> str:
        """Broadcast your reading of the question and per-sub-agent hints; every sub-agent then selects evidence pages and the answer model answers from them. Call it once.

        Args:
            interpretation: What the question asks in this region: the entities, relations and facts needed, including bridge facts.
            hints: Maps sub-agent ids (e.g. "s0") to what that sub-agent should look for in its pages. Sub-agents without a hint get the interpretation.

        Returns:
            The pages each sub-agent selected and the answer model's answer.
        """
        return await self._episode.broadcast(interpretation, hints, answer=self._answers)

    def get_reward(self) -> float:
        """Exact match of the answer model's answer (+ recall and budget terms when weighted)."""
        return self._episode.reward

    @property
    def episode(self) -> MidAgentEpisode:
        """The episode this environment drives (its public API: stats, terms, index, ...)."""
        return self._episode

    @property
    def info(self) -> dict[str, Any]:
        """Per-episode metrics (floats and ints only): reward terms, evidence, calls, errors."""
        return self._episode.info

    @property
    def tool_error_kinds(self) -> dict[str, int]:
        return self._episode.tool_error_kinds

    @property
    def selections(self) -> dict[str, list[int]]:
        """Selected page ids per participating sub-agent id."""
        return self._episode.selections

    @property
    def selector_inputs(self) -> list[dict[str, Any]]:
        """What each selector was given this episode: subagent, interpretation, hint (None when withheld)."""
        return self._episode.selector_inputs

    @property
    def answer(self) -> str | None:
        return self._episode.answer

    @property
    def index(self) -> DocumentIndex | None:
        return self._episode.index

    @property
    def sample(self) -> dict[str, Any]:
        return self._episode.sample


class HmarsEnvFactory:
    """``environment_factory`` for TRL: every call returns a fresh `MidAgentEnv` sharing backends,
    tokenizer and index cache (created on first use)."""

    def __init__(self, config: HmarsEnvConfig | None = None, tokenizer=None) -> None:
        self.config = config or HmarsEnvConfig()
        self._tokenizer = tokenizer
        self._backends: Backends | None = None
        self.index_cache = IndexCache(self.config.index_cache)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.tokenizer)
        return self._tokenizer

    @property
    def backends(self) -> Backends:
        if self._backends is None:
            self._backends = Backends(self.config)
        return self._backends

    def __call__(self, *, region: int = 0, answers: bool = True) -> MidAgentEnv:
        """A fresh environment bound to ``region`` on reset (see `MidAgentEnv`)."""
        return MidAgentEnv(self.config, self.backends, self.tokenizer, self.index_cache, region=region, answers=answers)

    def close(self) -> None:
        if self._backends is not None:
            shared_loop().run(self._backends.aclose())


# -- inference over all regions ------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_broadcast(text: str) -> dict[str, Any] | None:
    """Arguments of the first ``broadcast`` tool call in assistant text (``<tool_call>{json}</tool_call>``), or None."""
    for raw in _TOOL_CALL.findall(text or ""):
        if tool_call_too_deep(f"<tool_call>{raw}</tool_call>"):  # json.loads would raise RecursionError
            continue
        try:
            call = json.loads(raw)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") == "broadcast" and isinstance(call.get("arguments"), dict):
            return call["arguments"]
    return None


@dataclass
class MultiRegionResult:
    """One question answered by all K mid-agents: the merged evidence and the single answer.

    ``info`` holds question-level metrics (reward terms, ``regions``, ``pages_selected``,
    ``evidence_tokens``, ``answer_prompt_tokens``, ``model_calls`` = frozen selector + answer calls,
    ``policy_turns``, error counts); ``evidence`` one entry per merged page (``page``, ``region``,
    ``subagent``, ``documents``, ``tokens``, ``text``).
    """

    answer: str | None
    em: float
    f1: float
    recall: float
    pages: list[int]
    evidence_tokens: int
    answer_prompt_tokens: int
    model_calls: int
    regions: list[
        dict[str, Any]
    ]  # per region: region, subagents, pages, error, tool_errors, backend_errors (+ messages, info)
    info: dict[str, Any] = field(default_factory=dict)
    evidence: list[dict[str, Any]] = field(default_factory=list)


async def _answer_regions(episodes: list[MidAgentEpisode], regions: list[dict[str, Any]]) -> MultiRegionResult:
    """Merge the regions' selected pages, answer once on region 0's episode, and total the metrics."""
    answering = episodes[0]
    index = answering.index
    assert index is not None
    merged = sorted({p for r in regions for p in r["pages"]}, key=lambda p: index.pages[p].token_start)
    answer = await answering.answer_from([index.pages[p] for p in merged])
    terms = answering.terms()
    stats: list[EpisodeStats] = [e.stats for e in episodes]
    for r, st in zip(regions, stats, strict=True):
        r["tool_errors"] = sum(st.tool_errors.values())
        r["backend_errors"] = st.backend_errors
    selector_calls = sum(st.selector_calls for st in stats)
    answer_calls = sum(st.answer_calls for st in stats)
    region_of = {s: k for k, region in enumerate(index.regions) for s in region.subagents}
    evidence = [
        {
            "page": p, "region": region_of.get(index.pages[p].subagent), "subagent": index.pages[p].subagent,
            "documents": list(index.pages[p].documents), "tokens": [index.pages[p].token_start, index.pages[p].token_end],
            "text": index.pages[p].text,
        }
        for p in merged
    ]  # fmt: skip
    info: dict[str, Any] = {
        **terms,
        "regions": index.num_regions,
        "subagents": index.num_subagents,
        "broadcasts": sum(st.broadcasts for st in stats),
        "participants": sum(len(st.participants) for st in stats),
        "hinted": sum(len(st.hinted) for st in stats),
        "pages_selected": len(merged),
        "evidence_tokens": answering.stats.evidence_tokens,
        "answer_prompt_tokens": answering.stats.answer_prompt_tokens,
        "selector_calls": selector_calls,
        "answer_calls": answer_calls,
        "model_calls": selector_calls + answer_calls,
        "endpoint_calls": sum(st.endpoint_calls for st in stats),
        "tool_errors": sum(r["tool_errors"] for r in regions),
        "backend_errors": sum(st.backend_errors for st in stats),
        "parse_failures": sum(st.parse_failures for st in stats),
        **{k: sum(getattr(st, k) for st in stats) for k in ROLE_ERROR_KEYS},
        "regions_failed": sum(1 for r in regions if r.get("error")),
    }
    return MultiRegionResult(
        answer=answer.text if answer.ok else None,
        em=terms["em"],
        f1=terms["f1"],
        recall=terms["recall"],
        pages=merged,
        evidence_tokens=answering.stats.evidence_tokens,
        answer_prompt_tokens=answering.stats.answer_prompt_tokens,
        model_calls=selector_calls + answer_calls,
        regions=regions,
        info=info,
        evidence=evidence,
    )


_NO_BROADCAST = {
    "no_tokens": "no broadcast: the policy produced no tokens (completion budget spent)",
    "terminated": "no broadcast: the policy replied without a tool call",
    "truncated": "no broadcast: the policy ran out of tool rounds",
    "turn_limit": "no broadcast: the policy ran out of tool rounds",
}


def answer_all_regions(
    factory: HmarsEnvFactory,
    codec: Any,
    policy: Any,
    row: dict[str, Any],
    *,
    max_turns: int,
    max_completion_tokens: int | None = None,
    prompt_fn: Any = None,
    concurrency: int | None = None,
) -> MultiRegionResult:
    """Answer ``row`` with a trained mid-agent policy over all K regions of its document.

    The inference and evaluation path of ``protocol: hmars``. Each region runs in its own `StepEnv`
    (the policy tokenizer's `ChatCodec`: TRL's rendering and tool-call parsing, as in training) on
    a `MidAgentEnv` bound to that region whose broadcast stops after selection, driven by the
    shared episode loop (`coordrl.envs.step.play`); the K regions run concurrently in threads (an
    in-process model serialises its generations; a served one batches them). A region's episode
    ends at its first successful broadcast; after a refused broadcast the policy sees the error and
    may retry, up to ``max_turns`` tool rounds, as in training. A region whose policy never
    broadcasts contributes no pages and reports why. The answer model then answers once from the
    merged, offset-ordered pages.

    Args:
        factory: the environment factory (backends, tokenizer and index cache are shared).
        codec: the policy tokenizer's `coordrl.envs.chat.ChatCodec`.
        policy: an object with ``act(step_env) -> ids | text`` (`HFPolicy`, `OpenAIPolicy`, ...).
        row: ``question``, ``context`` (+ ``doc_offsets``, ``answers``, ``gold_documents`` when known).
        max_turns: tool rounds allowed per region.
        max_completion_tokens: cap on a region's turns and tool results (None: none).
        prompt_fn: the ``[system, user]`` prompt of a row (default: `hmars_prompt`).
        concurrency: regions in flight (default: all K).
    """
    prompt_fn = prompt_fn or (lambda r: hmars_prompt(r["question"]))
    probe = factory()
    probe.reset(**row)  # builds (or loads) the index once; every region then reads it from the cache
    assert probe.index is not None
    k_regions = probe.index.num_regions

    def one(k: int) -> tuple[dict[str, Any], MidAgentEpisode]:
        env = factory(region=k, answers=False)
        episode = env.episode
        step_env = StepEnv(
            env, codec, max_turns=max_turns, max_completion_tokens=max_completion_tokens,
            reward_fn=lambda completions, **kw: [episode.reward], prompt_fn=prompt_fn, require_stop=False,
        )  # fmt: skip
        step_env.reset(**row)
        out: dict[str, Any] = {"region": k, "subagents": episode.region_subagents, "pages": [], "error": None}
        try:
            # Selection done is this episode's end: the answer comes once, from all regions.
            (outcome,) = play(
                [step_env],
                lambda envs: [policy.act(envs[0])],
                max_turns + 1,
                stop=lambda e: episode.stats.broadcasts > 0,
            )
            if not episode.stats.broadcasts:
                out["error"] = _NO_BROADCAST[outcome.reason]
        except Exception as exc:
            out["error"] = f"policy failed: {type(exc).__name__}: {exc}"
        out["pages"] = list(episode.stats.pages)
        out["messages"] = step_env.messages
        out["info"] = {
            k2: step_env.info[k2] for k2 in ("tool_rounds", "tool_failures", "assistant_turns", "completion_tokens")
        }
        return out, episode

    workers = max(1, min(k_regions, concurrency or k_regions))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coordrl-hmars-region") as pool:
        done = list(pool.map(one, range(k_regions)))
    regions = [r for r, _ in done]
    result = shared_loop().run(_answer_regions([e for _, e in done], regions))
    result.info.update(
        policy_turns=sum(r["info"]["assistant_turns"] for r in regions),
        tool_rounds=sum(r["info"]["tool_rounds"] for r in regions),
        completion_tokens=sum(r["info"]["completion_tokens"] for r in regions),
    )
    return result
