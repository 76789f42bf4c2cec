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

The baselines (``--baseline prompted | mapreduce | fullcontext``) run in the same harness:
`coordrl.eval.baselines`.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from coordrl import __version__
from coordrl.data.errors import DataError
from coordrl.data.show import load_built
from coordrl.envs.chat import ChatCodec
from coordrl.envs.hmars import answer_all_regions
from coordrl.envs.protocols import EVAL_CHUNK_TOKENS, Protocol, get_protocol
from coordrl.envs.step import StepEnv
from coordrl.eval.baselines import BASELINES, FullContextEnv, MapReducePolicy, fullcontext_messages
from coordrl.eval.config import EvalConfig
from coordrl.eval.metrics import aggregate
from coordrl.eval.report import plot_accuracy, render_results_md
from coordrl.eval.resume import EVAL_CONFIG, check_resume, episode_settings, fingerprint
from coordrl.eval.subsets import SubsetSpec, discover_subsets
from coordrl.eval.traces import TraceWriter, read_traces
from coordrl.readers.fleet import make_fleet
from coordrl.rewards import score_prediction
from coordrl.rollout.episode import run_episode
from coordrl.rollout.models import resolve_model
from coordrl.rollout.policy_source import DEFAULT_MAX_NEW_TOKENS, PolicyError, load_policy, resolve_policy
from coordrl.rundir import RunLock

__all__ = ["EvalConfig", "evaluate"]


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


class _Runner:
    """Runs one sample end to end and turns it into a trace record."""

    def __init__(
        self, cfg: EvalConfig, source, policy, tokenizer, env_config, window: int | None, max_new_tokens: int
    ) -> None:
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
        baseline = self.cfg.baseline
        if baseline == "fullcontext":
            env = FullContextEnv()

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
            actor = MapReducePolicy(metered) if self.cfg.baseline == "mapreduce" else metered
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
# The run
# ---------------------------------------------------------------------------------------------------


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

    max_new_tokens = cfg.max_new_tokens or source.generation.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    policy, tokenizer = load_policy(
        source, policy_url=cfg.policy_url, served_model=cfg.served_model, device=cfg.device,
        max_new_tokens=max_new_tokens, temperature=cfg.temperature, seed=cfg.seed, weights=weights,
    )  # fmt: skip
    window = _window(cfg, policy, tokenizer)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = fingerprint(cfg, source, weights, max_new_tokens, window)
    check_resume(out, settings, cfg.overwrite)
    (out / EVAL_CONFIG).write_text(json.dumps({**settings, "coordrl_version": __version__}, indent=2) + "\n")

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
    writer = TraceWriter(out / "traces")
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
            **episode_settings(cfg, max_new_tokens, window),
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
