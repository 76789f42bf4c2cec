"""``coordrl eval``: run a coordinator policy over an evaluation sweep and report PARSER-style tables.

Every episode goes through the code path training uses: `ParserLeadEnv` (via `ParserEnvFactory`)
driven by `StepEnv` with the policy tokenizer's `ChatCodec`, played by `run_episode`. Settings
(system prompt, answer format, reader and observation settings) come from the checkpoint's
``coordrl_train.json`` or the export's ``coordrl_policy.json``; evaluation replaces the turn cap
(default 12) and reader chunk size (default 4,096 tokens), as PARSER does.

An ``hmars`` policy (HMARS mid-agent) is evaluated through `coordrl.envs.hmars.answer_all_regions`,
the path `Coordinator` answers with: every mid-agent region of the document runs the policy in its
own `StepEnv` (same codec, same TRL parsing, the `MidAgentEnv` reward as ``get_reward``), and the
answer model answers once from the merged pages; a document that fits one mid-agent (as the
training samples do) is exactly the training episode up to the broadcast. Region, page and
frozen-role settings are the recorded `HmarsEnvConfig` (``--hmars KEY=VALUE`` replaces one); the
turn cap defaults to training's. Beside accuracy the report gives the HMARS evidence metrics:
supporting-page recall, pages selected, answer-prompt tokens and model calls per question.

Episodes run concurrently in threads (``--concurrency``): an in-process model generates for one
episode at a time while the readers of the others keep working; a policy served by vLLM
(``--policy-url``) batches them. Each finished sample is appended to ``traces/<subset>.jsonl`` at
once, so an interrupted run resumes: ids with a successful trace are skipped, failed ones are run
again, and the latest record of an id counts.

Outputs in ``--out``: ``results.json`` (settings and metrics per subset and overall),
``results.md`` (tables), ``accuracy_vs_length.png``, ``traces/<subset>.jsonl`` (full conversation,
findings, scores and metrics of every sample) and ``eval_config.json`` (the settings a rerun must
match).

Baselines in the same harness (``--baseline``):

- ``prompted``: the untrained base model with the trained policy's prompt and settings (for a
  checkpoint or export: its recorded ``base_model``). Equivalent to ``--policy <base model>``.
- ``mapreduce``: one round. A scripted first turn broadcasts the question to all readers with
  ``query_agents([question])``; the model then answers from the findings in one generation (a tool
  call in that generation ends the episode unanswered).
- ``fullcontext``: no readers; the whole document in one prompt, middle-truncated to fit the model's
  window (``--context-window``, default the model's ``max_position_embeddings`` or the server's
  ``max_model_len``); the cut token counts are reported.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from coordrl import __version__
from coordrl.data.errors import DataError
from coordrl.envs.protocols import EVAL_CHUNK_TOKENS, Protocol, get_protocol
from coordrl.rewards import ANSWER_CLOSE, ANSWER_OPEN, score_prediction
from coordrl.rewards.metrics import nearest_rank_percentile
from coordrl.rundir import RunLock, truncate_torn_tail

__all__ = [
    "BASELINES",
    "FULLCONTEXT_SYSTEM_PROMPT",
    "EvalConfig",
    "SubsetSpec",
    "aggregate",
    "discover_subsets",
    "evaluate",
    "fullcontext_messages",
]

BASELINES = ("prompted", "mapreduce", "fullcontext")
EVAL_CONFIG = "eval_config.json"
# Settings that change what an episode does: a rerun into the same --out must match them.
_FINGERPRINT_KEYS = (
    "policy",
    "baseline",
    "weights",
    "data",
    "readers",
    "reader_model",
    "max_turns",
    "chunk_tokens",
    "chunk_overlap_tokens",
    "activation",
    "max_new_tokens",
    "temperature",
    "seed",
    "context_window",
    "max_completion_tokens",
    "hmars",
)

FULLCONTEXT_SYSTEM_PROMPT = (
    "You answer questions about a document. Read the document, then reply with the answer inside "
    f"{ANSWER_OPEN}{ANSWER_CLOSE} and nothing else after it, for example {ANSWER_OPEN}Paris{ANSWER_CLOSE}. "
    "Give the shortest answer: a name, a date, a number, or yes/no."
)
_CUT_MARKER = "\n\n[... {cut} tokens cut from the middle of the document ...]\n\n"


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


@dataclass
class SubsetSpec:
    """One dataset of the evaluation: ``name`` is its folder name (and trace file)."""

    name: str
    variant: str
    kind: str
    value: str
    folder: Path
    paragraphs: float | None = None


@dataclass
class _Task:
    subset: SubsetSpec
    index: int
    sample_id: str


@dataclass
class _RunStats:
    ran: int = 0
    skipped: int = 0
    failed: int = 0
    cut_tokens: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def discover_subsets(data: str | Path) -> list[SubsetSpec]:
    """The subsets of a sweep folder (from ``sweep.json``), or the one dataset folder given."""
    data = Path(data)
    manifest = data / "sweep.json"
    if manifest.exists():
        try:
            subsets = json.loads(manifest.read_text())["subsets"]
        except (ValueError, KeyError) as e:
            raise DataError(f"{manifest}: not a coordrl sweep manifest ({e})") from None
        out = []
        for s in subsets:
            kind, _, value = str(s["variant"]).partition("=")
            paragraphs = float(value) if kind == "length" else (s.get("stats") or {}).get("paragraphs", {}).get("mean")
            out.append(SubsetSpec(s["folder"], s["variant"], kind, value, data / s["folder"], paragraphs))
        return out
    if (data / "state.json").exists():
        from coordrl.data.show import load_built

        ds = load_built(data)
        variant = ds[0]["variant"] if len(ds) and "variant" in ds.column_names and ds[0]["variant"] else ""
        paragraphs = (
            statistics.median(ds["num_paragraphs"]) if "num_paragraphs" in ds.column_names and len(ds) else None
        )
        if variant:
            kind, _, value = variant.partition("=")
        else:
            kind, value = "length", str(int(paragraphs or 0))
        return [
            SubsetSpec(
                data.name,
                variant or f"length={value}",
                kind,
                value,
                data,
                paragraphs if kind != "length" else float(value),
            )
        ]
    raise DataError(f"--data {data}: neither a sweep folder (sweep.json) nor a dataset folder written by coordrl")


# ---------------------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------------------


def read_traces(path: Path) -> dict[str, dict[str, Any]]:
    """Latest record per sample id of a trace file; a torn last line (crash mid-write) is ignored."""
    latest: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return latest
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                latest[str(rec["id"])] = rec
    return latest


class _TraceWriter:
    """Appends one JSON line per finished sample, flushed at once (that is what makes resuming safe)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._checked: set[str] = set()

    def write(self, subset: str, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        path = self.folder / f"{subset}.jsonl"
        with self._lock:
            if subset not in self._checked:
                self._checked.add(subset)
                # A crash mid-write leaves a torn last line: cut it, so the file stays valid JSONL (the
                # sample it held has no complete record, so this run does it again).
                truncate_torn_tail(path)
            # A lone surrogate (a policy's tool-call JSON can spell one) is written as its JSON escape.
            with open(path, "a", encoding="utf-8", errors="backslashreplace") as fh:
                fh.write(line)
                fh.flush()


# ---------------------------------------------------------------------------------------------------
# Episodes
# ---------------------------------------------------------------------------------------------------


class _Metered:
    """Per-episode wrapper: records the prompt length of every policy turn and the time spent."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.prompt_tokens: list[int] = []
        self.seconds = 0.0
        self._lock = threading.Lock()  # hmars: the K regions of one sample act from several threads

    def act(self, env):
        with self._lock:
            self.prompt_tokens.append(len(env.context_ids))
        t0 = time.perf_counter()
        try:
            return self.policy.act(env)
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - t0


class _MapReduce:
    """``mapreduce`` baseline: the scripted lead's broadcast of the question, then one model generation."""

    def __init__(self, inner: _Metered) -> None:
        from coordrl.rollout.policies import ScriptedLead

        self.inner = inner
        self.first = ScriptedLead()  # its first turn is exactly query_agents([question])

    def act(self, env):
        if not env.completion:
            return self.first.act(env)
        return self.inner.act(env)


class _FullContextEnv:
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


class _Runner:
    """Runs one sample end to end and turns it into a trace record."""

    def __init__(
        self, cfg: EvalConfig, source, policy, tokenizer, env_config, window: int | None, max_new_tokens: int
    ) -> None:
        from coordrl.envs.chat import ChatCodec

        self.cfg = cfg
        self.source = source
        self.policy = policy
        self.codec = ChatCodec(tokenizer)
        self.env_config = env_config
        protocol = get_protocol(source.protocol)
        self.by_region = protocol.answers_by_region and cfg.baseline != "fullcontext"
        self.factory = protocol.factory(env_config, tokenizer=tokenizer)
        self.window = window
        self.max_new_tokens = max_new_tokens

    def _step_env(self, row: dict[str, Any]):
        from coordrl.envs.step import StepEnv

        baseline = self.cfg.baseline
        if baseline == "fullcontext":
            env = _FullContextEnv()

            def fullcontext_prompt(r: dict[str, Any]) -> list[dict[str, str]]:
                msgs, stats = fullcontext_messages(r, self.codec, self.window or 0, self.max_new_tokens)
                env.stats = stats
                return msgs

            # max_turns=0: a tool call in the only turn ends the episode unanswered.
            return StepEnv(
                env,
                self.codec,
                max_turns=0,
                max_completion_tokens=self.cfg.max_completion_tokens,
                prompt_fn=fullcontext_prompt,
            )
        turns = 1 if baseline == "mapreduce" else self.env_config.max_turns
        return StepEnv(
            self.factory(), self.codec, max_turns=turns, max_completion_tokens=self.cfg.max_completion_tokens,
            prompt_fn=lambda r: self.source.prompt(r["question"]),
        )  # fmt: skip

    def run(self, task: _Task, row: dict[str, Any]) -> dict[str, Any]:
        from coordrl.rollout.episode import run_episode

        base = {
            "id": task.sample_id,
            "subset": task.subset.name,
            "variant": task.subset.variant,
            "question": row.get("question"),
            "answers": list(row.get("answers") or []),
            "num_paragraphs": row.get("num_paragraphs"),
            "num_tokens": row.get("num_tokens"),
            "gold_documents": list(row.get("gold_documents") or []),
        }
        t0 = time.perf_counter()
        metered = _Metered(self.policy)
        if self.by_region:
            return self._run_by_region(base, row, metered, t0)
        try:
            env = self._step_env(row)
            actor = _MapReduce(metered) if self.cfg.baseline == "mapreduce" else metered
            episode = run_episode(env, actor, row)
        except Exception as e:
            return {
                **base,
                "status": "failed",
                "error": f"{type(e).__name__}: {e}",
                "seconds": round(time.perf_counter() - t0, 3),
            }
        record = episode.to_dict()
        record.update(base)
        record.update(
            status="ok",
            scores=score_prediction(episode.prediction, episode.answers),
            lead_prompt_tokens=sum(metered.prompt_tokens),
            lead_turn_prompt_tokens=metered.prompt_tokens,
            policy_seconds=round(metered.seconds, 3),
        )
        return record

    def _run_by_region(self, base: dict[str, Any], row: dict[str, Any], metered: _Metered, t0: float) -> dict[str, Any]:
        """One sample of an hmars policy: all regions (`answer_all_regions`), one answer, evidence metrics."""
        from coordrl.envs.hmars import answer_all_regions

        try:
            result = answer_all_regions(
                self.factory, self.codec, metered, row, max_turns=self.cfg.max_turns,
                max_completion_tokens=self.cfg.max_completion_tokens, prompt_fn=lambda r: self.source.prompt(r["question"]),
            )  # fmt: skip
        except Exception as e:
            return {
                **base,
                "status": "failed",
                "error": f"{type(e).__name__}: {e}",
                "seconds": round(time.perf_counter() - t0, 3),
            }
        regions = [{k: v for k, v in r.items()} for r in result.regions]
        return {
            **base,
            "status": "ok",
            "prediction": result.answer,  # the answer model's answer from the merged evidence: what HMARS outputs
            "reward": result.info.get("reward", 0.0),
            "terminated": all(r.get("error") is None for r in regions),
            "seconds": round(time.perf_counter() - t0, 3),
            "info": result.info,
            "scores": score_prediction(result.answer, base["answers"]),
            "evidence": [{k: v for k, v in e.items() if k != "text"} for e in result.evidence],
            "messages": regions[0]["messages"] if regions else [],  # region 0's conversation, as a PARSER trace
            "regions": regions,
            "lead_prompt_tokens": sum(metered.prompt_tokens),
            "lead_turn_prompt_tokens": metered.prompt_tokens,
            "policy_seconds": round(metered.seconds, 3),
        }

    def close(self) -> None:
        self.factory.close()


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def aggregate(records: Sequence[dict[str, Any]], drop_failed: bool = False, protocol: str = "parser") -> dict[str, Any]:
    """Metrics of a set of trace records.

    Accuracy (``sub_em``, ``guarded_sub_em``, ``em``, ``f1``) and ``answered`` are means over the
    samples, a failed sample scoring 0 (or left out with ``drop_failed``). Process metrics are means
    over successful samples: ``turns`` (tool rounds), ``queries_per_turn`` (all queries / all
    rounds), ``reader_calls``, ``lead_prompt_tokens`` (prompt tokens the policy read over all its
    turns), ``lead_completion_tokens``, ``gold_coverage`` (a reader of a chunk holding a gold
    paragraph answered), and per-sample latency percentiles ``latency_p50_s`` / ``latency_p95_s``.

    For ``protocol="hmars"`` the HMARS evidence metrics are added (means over successful samples):
    ``recall`` (supporting-page recall: share of gold Documents covered by the selected pages),
    ``pages_selected``, ``evidence_tokens``, ``answer_prompt_tokens``, ``model_calls`` (frozen
    selector and answer calls per question) and ``regions`` (mid-agents per question). Failures of the frozen roles are
    totals over successful samples: ``reader_errors`` (PARSER), and for HMARS ``selector_errors``,
    ``selector_parse_failures``, ``answerer_errors``, ``answerer_parse_failures``.
    """
    ok = [r for r in records if r.get("status") == "ok"]
    failed = [r for r in records if r.get("status") != "ok"]
    denom = len(ok) if drop_failed else len(ok) + len(failed)
    out: dict[str, Any] = {"samples": denom, "evaluated": len(ok) + len(failed), "failed": len(failed)}
    for metric in ("sub_em", "guarded_sub_em", "em", "f1"):
        out[metric] = sum(r["scores"][metric] for r in ok) / denom if denom else None
    out["answered"] = sum(r.get("prediction") is not None for r in ok) / denom if denom else None
    infos = [r.get("info") or {} for r in ok]
    rounds = sum(i.get("turns", 0) for i in infos)
    out["turns"] = _mean(i.get("turns", 0) for i in infos)
    out["queries_per_turn"] = (sum(i.get("queries", 0) for i in infos) / rounds) if rounds else (0.0 if ok else None)
    out["reader_calls"] = _mean(i.get("reader_calls", 0) for i in infos)
    out["lead_prompt_tokens"] = _mean(r.get("lead_prompt_tokens", 0) for r in ok)
    out["lead_completion_tokens"] = _mean(i.get("completion_tokens", 0) for i in infos)
    covered = [i["gold_coverage"] for i, r in zip(infos, ok) if "gold_coverage" in i and r.get("gold_documents")]
    out["gold_coverage"] = _mean(covered)
    out["reader_errors"] = sum(i.get("reader_errors", 0) for i in infos)
    latencies = [float(r.get("seconds", 0.0)) for r in ok]
    out["latency_p50_s"] = nearest_rank_percentile(latencies, 50)
    out["latency_p95_s"] = nearest_rank_percentile(latencies, 95)
    out["latency_mean_s"] = _mean(latencies)
    spec = get_protocol(protocol)
    for key in spec.eval_metrics:
        out[key] = _mean(float(i.get(key, 0)) for i in infos)
    for key in spec.role_error_metrics:  # totals, like reader_errors: a broken role is named in the table
        out[key] = sum(i.get(key, 0) for i in infos)
    return out


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


def _fingerprint(
    cfg: EvalConfig, source, weights: str | None, max_new_tokens: int, window: int | None
) -> dict[str, Any]:
    return {
        "policy": str(Path(source.path).resolve()) if source.path and Path(source.path).exists() else source.spec,
        "baseline": cfg.baseline,
        "weights": weights,
        "data": str(Path(cfg.data).resolve()),
        **_episode_settings(cfg, max_new_tokens, window),
        "hmars": cfg.hmars,  # None for PARSER: earlier PARSER evaluations still resume
    }


def _episode_settings(cfg: EvalConfig, max_new_tokens: int, window: int | None) -> dict[str, Any]:
    """What decides an episode's outcome: the resume fingerprint and ``results.json`` both record it."""
    return {
        "readers": cfg.readers,
        "reader_model": cfg.reader_model,
        "max_turns": cfg.max_turns,
        "chunk_tokens": cfg.chunk_tokens,
        "chunk_overlap_tokens": cfg.chunk_overlap_tokens,  # None: the policy's own (earlier runs still resume)
        "activation": cfg.activation,  # None: the policy's own, as for the overlap
        "max_new_tokens": max_new_tokens,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "context_window": window,
        "max_completion_tokens": cfg.max_completion_tokens,
    }


def _check_resume(out: Path, fingerprint: dict[str, Any], overwrite: bool) -> None:
    import shutil

    path = out / EVAL_CONFIG
    if overwrite:
        for name in ("traces", "results.json", "results.md", "accuracy_vs_length.png", EVAL_CONFIG):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        return
    if not path.exists():
        if (out / "traces").exists() and any((out / "traces").iterdir()):
            raise DataError(f"{out} holds traces but no {EVAL_CONFIG}; pass --overwrite or another --out")
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        raise DataError(f"{path} is not valid JSON; pass --overwrite or another --out") from None
    for key in _FINGERPRINT_KEYS:
        if old.get(key) != fingerprint.get(key):
            raise DataError(
                f"{out} holds an evaluation with other settings ({key}: {old.get(key)!r} there, {fingerprint.get(key)!r} now); "
                "pass --overwrite or another --out"
            )


def _window(cfg: EvalConfig, policy, tokenizer) -> int | None:
    if cfg.baseline != "fullcontext":
        return None
    if cfg.context_window:
        return cfg.context_window
    inner = getattr(policy, "policy", policy)
    if hasattr(inner, "max_model_len"):
        found = inner.max_model_len()
        if found:
            return int(found)
    model = getattr(inner, "model", None)
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if n:
        return int(n)
    n = getattr(tokenizer, "model_max_length", None)
    if n and n < 10**7:
        return int(n)
    raise DataError("--baseline fullcontext: cannot tell the model's context window; pass --context-window N")


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Run (or resume) an evaluation and write its outputs; returns ``results.json``'s content."""
    from coordrl.inference.export import PolicyError, resolve_policy
    from coordrl.rollout.models import resolve_model

    if cfg.baseline is not None and cfg.baseline not in BASELINES:
        raise DataError(f"--baseline must be one of {', '.join(BASELINES)}, got {cfg.baseline!r}")
    if (
        cfg.concurrency < 1
        or (cfg.max_turns is not None and cfg.max_turns < 1)
        or (cfg.chunk_tokens is not None and cfg.chunk_tokens < 1)
        or (cfg.limit is not None and cfg.limit < 1)
    ):
        raise DataError("--concurrency, --max-turns, --chunk-tokens and --limit must be positive")
    if cfg.chunk_overlap_tokens is not None and cfg.chunk_overlap_tokens < 0:
        raise DataError(f"--chunk-overlap-tokens must be >= 0, got {cfg.chunk_overlap_tokens}")
    subsets = discover_subsets(cfg.data)
    source = resolve_policy(cfg.policy)
    protocol = get_protocol(source.protocol)
    if not protocol.uses_readers and cfg.baseline == "mapreduce":
        raise DataError(
            "--baseline mapreduce is PARSER's one-round baseline; for an hmars policy compare the ablations instead (--hmars mode=no_mid)"
        )
    cfg = replace(cfg, max_turns=source.eval_max_turns(cfg.max_turns))
    if source.kind == "scripted" and cfg.baseline:
        raise DataError(f"--baseline {cfg.baseline} needs a model policy, not 'scripted'")
    weights = None
    # For a plain model, --baseline prompted changes nothing: it already is the untrained model.
    if cfg.baseline == "prompted" and source.kind in ("checkpoint", "export"):
        if not source.base_model:
            raise PolicyError(
                f"{source.spec} records no base_model; pass --policy <base model> instead of --baseline prompted"
            )
        try:
            weights = resolve_model(source.base_model)
        except ValueError as e:  # the recorded base model is gone: one line naming it
            raise PolicyError(f"--baseline prompted: {source.spec} records a base {e}") from None
    try:
        # Round caps are reader settings with evaluation defaults; HMARS regions and pages come from
        # the recorded env. The chunk size, overlap and activation go to the protocol as given (None
        # when not): PARSER applies its evaluation chunk size, HMARS refuses them by name instead of
        # dropping them.
        reader_args = {"max_turns": cfg.max_turns} if protocol.uses_readers else {}
        env_config = source.env_config(
            readers=cfg.readers, reader_model=cfg.reader_model, hmars=cfg.hmars, **reader_args,
            chunk_tokens=cfg.chunk_tokens, chunk_overlap_tokens=cfg.chunk_overlap_tokens, activation=cfg.activation,
        )  # fmt: skip
        # The resume fingerprint records that default for both protocols, as before HMARS refused
        # the flag, so earlier evaluations still resume.
        cfg = replace(cfg, chunk_tokens=cfg.chunk_tokens or EVAL_CHUNK_TOKENS)
        if cfg.baseline != "fullcontext" and protocol.uses_readers:
            from coordrl.readers.fleet import make_fleet

            make_fleet(env_config.readers, env_config.reader_model)  # a bad --readers fails before any model loads
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise DataError(str(e)) from None
    env_config = _with_reader_limits(env_config, cfg, protocol)
    with RunLock(Path(cfg.out), what="--out", break_lock=cfg.break_lock):
        return _evaluate_locked(cfg, source, subsets, weights, env_config)


def _with_reader_limits(env_config, cfg: EvalConfig, protocol: Protocol):
    """``env_config`` with the ``--reader-timeout`` / ``--reader-retries`` given (hmars: backend limits)."""
    given = dict(zip(protocol.limit_fields, (cfg.reader_timeout_s, cfg.reader_retries), strict=True))
    fixed = set(cfg.hmars or {}) if protocol.settings_block else set()  # an explicit --hmars backend_timeout_s=... wins
    return replace(env_config, **{k: v for k, v in given.items() if v is not None and k not in fixed})


def _evaluate_locked(
    cfg: EvalConfig, source, subsets: list[SubsetSpec], weights: str | None, env_config
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from coordrl.data.show import load_built
    from coordrl.eval.report import plot_accuracy, render_results_md
    from coordrl.inference.coordinator import DEFAULT_MAX_NEW_TOKENS, load_policy

    max_new_tokens = cfg.max_new_tokens or source.generation.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    policy, tokenizer = load_policy(
        source, policy_url=cfg.policy_url, served_model=cfg.served_model, device=cfg.device,
        max_new_tokens=max_new_tokens, temperature=cfg.temperature, seed=cfg.seed, weights=weights,
    )  # fmt: skip
    window = _window(cfg, policy, tokenizer)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(cfg, source, weights, max_new_tokens, window)
    _check_resume(out, fingerprint, cfg.overwrite)
    (out / EVAL_CONFIG).write_text(json.dumps({**fingerprint, "coordrl_version": __version__}, indent=2) + "\n")

    # Which samples each subset holds (first --limit rows), and which are already done.
    datasets = {}
    tasks: list[_Task] = []
    selected: dict[str, list[str]] = {}
    stats = _RunStats()
    for sub in subsets:
        ds = load_built(sub.folder)
        n = len(ds) if cfg.limit is None else min(cfg.limit, len(ds))
        ids = [str(x) for x in ds.select(range(n))["id"]]
        datasets[sub.name] = ds
        selected[sub.name] = ids
        done = {i for i, r in read_traces(out / "traces" / f"{sub.name}.jsonl").items() if r.get("status") == "ok"}
        for index, sid in enumerate(ids):
            if sid in done:
                stats.skipped += 1
            else:
                tasks.append(_Task(sub, index, sid))

    runner = _Runner(cfg, source, policy, tokenizer, env_config, window, max_new_tokens)
    writer = _TraceWriter(out / "traces")
    row_lock = threading.Lock()
    label = cfg.label or (source.label + (f" [{cfg.baseline}]" if cfg.baseline else ""))
    t_start = time.perf_counter()

    def work(task: _Task) -> dict[str, Any]:
        with row_lock:  # Arrow reads are cheap; serialising them avoids sharing one table across threads
            row = dict(datasets[task.subset.name][task.index])
        record = runner.run(task, row)
        writer.write(task.subset.name, record)
        return record

    bar = tqdm(total=len(tasks), desc=f"eval {label}", unit="sample", dynamic_ncols=True, disable=not cfg.progress)
    pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="coordrl-eval")
    try:
        futures = [pool.submit(work, t) for t in tasks]
        hits = 0.0
        for fut in as_completed(futures):
            record = fut.result()
            stats.ran += 1
            if record["status"] != "ok":
                stats.failed += 1
            else:
                hits += record["scores"]["sub_em"]
            bar.update()
            bar.set_postfix(sub_em=f"{hits / stats.ran:.3f}", failed=stats.failed)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # finished samples are on disk: a rerun resumes
        raise
    finally:
        bar.close()
        runner.close()
        close = getattr(getattr(policy, "policy", policy), "close", None)
        if callable(close):
            close()
    pool.shutdown(wait=True)

    results = _results(
        cfg,
        source,
        weights,
        label,
        subsets,
        datasets,
        selected,
        out,
        stats,
        time.perf_counter() - t_start,
        max_new_tokens,
        window,
        env_config,
    )
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "results.md").write_text(render_results_md(results), encoding="utf-8")
    plot_accuracy([results], out / "accuracy_vs_length.png")
    return results


def _results(
    cfg, source, weights, label, subsets, datasets, selected, out, stats, seconds, max_new_tokens, window, env_config
) -> dict[str, Any]:
    rows = []
    main_records: list[dict[str, Any]] = []
    cut: list[int] = []
    for sub in subsets:
        traces = read_traces(out / "traces" / f"{sub.name}.jsonl")
        records = [traces[i] for i in selected[sub.name] if i in traces]
        ds = datasets[sub.name]
        n = len(selected[sub.name])
        tokens = ds.select(range(n))["num_tokens"] if "num_tokens" in ds.column_names and n else []
        metrics = aggregate(records, cfg.drop_failed, source.protocol)
        metrics["missing"] = n - len(records)
        rows.append({
            "name": sub.name, "variant": sub.variant, "kind": sub.kind, "value": sub.value,
            "paragraphs": sub.paragraphs, "tokens_mean": (sum(tokens) / len(tokens)) if tokens else None, "metrics": metrics,
        })  # fmt: skip
        if sub.kind == "length":
            main_records += records
        cut += [int((r.get("info") or {}).get("cut_tokens", 0)) for r in records if r.get("status") == "ok"]
    overall = aggregate(main_records, cfg.drop_failed, source.protocol) if main_records else None
    results: dict[str, Any] = {
        "coordrl_version": __version__,
        "label": label,
        "policy": {
            "spec": source.spec,
            "kind": source.kind,
            "path": source.path,
            "base_model": source.base_model,
            "weights": weights,
            "url": cfg.policy_url,
        },
        "protocol": source.protocol,
        "baseline": cfg.baseline,
        "data": str(cfg.data),
        "settings": {
            **_episode_settings(cfg, max_new_tokens, window),
            "limit": cfg.limit,
            "drop_failed": cfg.drop_failed,
            "concurrency": cfg.concurrency,
            "hmars": cfg.hmars,
        },
        "env": env_config.to_dict(),
        "subsets": rows,
        "overall": overall,
        "run": {
            "episodes_run": stats.ran,
            "episodes_skipped": stats.skipped,
            "episodes_failed": stats.failed,
            "seconds": round(seconds, 2),
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }
    if cfg.baseline == "fullcontext":
        results["fullcontext"] = {
            "window": window, "samples": len(cut), "truncated": sum(c > 0 for c in cut),
            "cut_tokens_total": sum(cut), "cut_tokens_mean": (sum(cut) / len(cut)) if cut else 0.0,
        }  # fmt: skip
    return results


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
