"""`EvalConfig`: the inputs of an evaluation (field names match ``coordrl eval``'s flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EvalConfig"]


@dataclass
class EvalConfig:
    """Inputs of `evaluate` (field names match the CLI flags).

    Attributes:
        policy: checkpoint, export, model folder, hub id or ``scripted``.
        data: a sweep folder (``sweep.json``) or one dataset folder.
        out: output folder.
        readers / reader_model: ``lexical`` (default) or reader server URLs and their model name.
        policy_url / served_model: evaluate through an OpenAI-compatible server (default: in-process).
        max_turns: tool rounds (default 12; ``hmars``: per region, default training's cap).
        chunk_tokens: reader chunk size (default None: 4096; an ``hmars`` policy refuses it).
        chunk_overlap_tokens: tokens each reader chunk shares with the next (default None: the
            policy's recorded setting, else 0; not used by ``hmars``).
        activation: which chunk readers a query wakes, ``all`` or ``routed`` (default None: the
            policy's recorded setting, else ``all``; not used by ``hmars``).
        hmars: `HmarsEnvConfig` fields replacing an ``hmars`` policy's recorded ones (default None).
        limit: first N samples of each subset (default all).
        concurrency: episodes in flight (default 4).
        baseline: None, ``prompted``, ``mapreduce`` or ``fullcontext``.
        drop_failed: leave failed samples out of the denominators (reference habit; default False:
            a failed sample scores 0).
        seed: sampling seed (default 0). temperature: 0 = greedy (default).
        max_new_tokens: tokens per policy turn (default: training's cap, else 512).
        max_completion_tokens: cap on all turns and tool results of an episode (default None).
        context_window: ``fullcontext`` window in tokens (default: the model's).
        device: in-process device. label: name in tables and plots (default from the policy).
        overwrite: discard earlier results in ``out`` (default False: resume them).
        progress: show a progress bar (default True).
        reader_timeout_s / reader_retries: per-attempt limit and retries of a reader request
            (default None: the policy's recorded settings, else 60 s and 3); for ``hmars`` policies the
            frozen backends' ``backend_timeout_s`` / ``backend_retries`` unless ``hmars`` sets them.
        break_lock: take over ``out``'s lock left by a run on another host (default False).

    The evaluation holds ``out``'s lock (`coordrl.rundir.RunLock`) while it runs.
    """

    policy: str
    data: str
    out: str
    readers: str = "lexical"
    reader_model: str | None = None
    policy_url: str | None = None
    served_model: str | None = None
    max_turns: int | None = None
    chunk_tokens: int | None = None
    chunk_overlap_tokens: int | None = None
    activation: str | None = None
    limit: int | None = None
    concurrency: int = 4
    baseline: str | None = None
    drop_failed: bool = False
    seed: int = 0
    temperature: float = 0.0
    max_new_tokens: int | None = None
    max_completion_tokens: int | None = None
    context_window: int | None = None
    device: str | None = None
    label: str | None = None
    overwrite: bool = False
    progress: bool = True
    hmars: dict[str, Any] | None = None
    reader_timeout_s: float | None = None
    reader_retries: int | None = None
    break_lock: bool = False
