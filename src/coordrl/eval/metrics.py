"""The metrics of a set of evaluation trace records (one row of ``results.json``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from coordrl.envs.protocols import get_protocol
from coordrl.rewards.metrics import nearest_rank_percentile

__all__ = ["aggregate"]


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
