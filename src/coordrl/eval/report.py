"""Tables and plots of ``coordrl eval`` results: ``results.md``, ``accuracy_vs_length.png`` and
the side-by-side comparison of ``coordrl eval --compare``.

Tables follow the PARSER paper's shape: one row per document length (paragraphs, with the mean
token count), one column per metric, an overall row; robustness controls (position / order /
distance variants) get their own table. Accuracy figures are percentages.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from coordrl.data.errors import DataError
from coordrl.envs.protocols import get_protocol

__all__ = [
    "ACCURACY_METRICS",
    "columns_for",
    "compare_results",
    "load_results",
    "plot_accuracy",
    "render_comparison_md",
    "render_results_md",
]

RESULTS_JSON = "results.json"
ACCURACY_METRICS = ("sub_em", "guarded_sub_em", "em", "f1")


def _pct(v: Any) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _num(digits: int) -> Callable[[Any], str]:
    return lambda v: "–" if v is None else f"{v:,.{digits}f}"


def _int(v: Any) -> str:
    return "–" if v is None else f"{round(v):,}"


# How each metric of the per-length table prints; which metrics a table shows, and under which
# header, is the protocol's (`Protocol.table_columns`).
_FORMATS: dict[str, Callable[[Any], str]] = {
    "samples": _int, "sub_em": _pct, "guarded_sub_em": _pct, "em": _pct, "f1": _pct, "answered": _pct,
    "turns": _num(2), "queries_per_turn": _num(2), "reader_calls": _num(1), "lead_prompt_tokens": _int,
    "latency_p50_s": _num(2), "latency_p95_s": _num(2), "gold_coverage": _pct, "reader_errors": _int, "failed": _int,
    "recall": _pct, "pages_selected": _num(1), "answer_prompt_tokens": _int, "model_calls": _num(1),
    "regions": _num(1), "selector_errors": _int, "selector_parse_failures": _int, "answerer_errors": _int,
    "answerer_parse_failures": _int, "activated_chunks_per_query": _num(1), "reader_prompt_tokens": _int,
    "normalised_cost": _int, "gold_activation_recall": _pct,
}  # fmt: skip
_SHORT = {"sub_em": "sub_em", "guarded_sub_em": "guarded", "em": "EM", "f1": "F1"}


def columns_for(results: dict[str, Any]) -> list[tuple[str, str, Callable[[Any], str]]]:
    """``(key, header, formatter)`` of the per-length table: the columns of the results' protocol."""
    protocol = get_protocol(results.get("protocol") or "parser")
    return [(key, header, _FORMATS.get(key, _num(2))) for key, header in protocol.table_columns]


def load_results(folder: str | Path) -> dict[str, Any]:
    """``results.json`` of an eval output folder (DataError naming the folder when absent)."""
    path = Path(folder) / RESULTS_JSON
    if not path.exists():
        raise DataError(f"{folder}: no {RESULTS_JSON} (not a coordrl eval --out folder, or the run has not finished)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _length_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [s for s in results["subsets"] if s["kind"] == "length"]
    return sorted(rows, key=lambda s: (s["paragraphs"] or 0, s["name"]))


def _control_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    order = {"position": 0, "order": 1, "distance": 2}
    rows = [s for s in results["subsets"] if s["kind"] != "length"]
    return sorted(rows, key=lambda s: (order.get(s["kind"], 9), _sort_value(s["value"])))


def _sort_value(value: str) -> tuple[int, Any]:
    named = {"start": 0, "middle": 1, "end": 2, "forward": 0, "reversed": 1}
    if value in named:
        return (0, named[value])
    try:
        return (1, float(value))
    except ValueError:
        return (2, value)


def render_results_md(results: dict[str, Any]) -> str:
    """``results.md`` of one evaluation."""
    s = results["settings"]
    failed_rule = "dropped from the denominator (--drop-failed)" if s.get("drop_failed") else "scored 0"
    columns = columns_for(results)
    protocol = get_protocol(results.get("protocol") or "parser")
    setup, legend = protocol.report_setup(results.get("env") or {}, s, failed_rule)
    lines = [
        f"# Evaluation: {results['label']}",
        "",
        f"- policy: `{results['policy']['spec']}` ({results['policy']['kind']})"
        + (f", baseline **{results['baseline']}**" if results.get("baseline") else "")
        + (f", weights `{results['policy']['weights']}`" if results["policy"].get("weights") else ""),
        f"- data: `{results['data']}`"
        + (
            f"; readers: `{s['readers']}`" + (f" (`{s['reader_model']}`)" if s.get("reader_model") else "")
            if protocol.uses_readers
            else ""
        ),
        setup,
        legend,
        "",
        "## Accuracy by length",
        "",
    ]
    header = ["paragraphs", "tokens (mean)"] + [h for _, h, _ in columns]
    rows = [
        [_int(r["paragraphs"]), _int(r.get("tokens_mean"))] + [f(r["metrics"].get(k)) for k, _, f in columns]
        for r in _length_rows(results)
    ]
    overall = results.get("overall")
    if overall and rows:
        rows.append(["**overall**", ""] + [f(overall.get(k)) for k, _, f in columns])
    lines += _table(header, rows) if rows else ["(no length subsets)"]
    controls = _control_rows(results)
    if controls:
        lengths = sorted({int(c["paragraphs"]) for c in controls if c.get("paragraphs")})
        at = f" ({', '.join(str(n) for n in lengths)} paragraphs)" if lengths else ""
        lines += ["", f"## Robustness{at}", ""]
        header = ["control", "tokens (mean)"] + [h for _, h, _ in columns]
        lines += _table(
            header,
            [
                [c["variant"], _int(c.get("tokens_mean"))] + [f(c["metrics"].get(k)) for k, _, f in columns]
                for c in controls
            ],
        )
    if results.get("fullcontext"):
        fc = results["fullcontext"]
        lines += ["", (f"Full-context baseline: window {fc['window']:,} tokens; {fc['truncated']} of {fc['samples']} documents "
                  f"middle-truncated, {fc['cut_tokens_total']:,} tokens cut in all (mean {fc['cut_tokens_mean']:,.0f} per sample).")]  # fmt: skip
    return "\n".join(lines) + "\n"


def _labels(results_list: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> list[str]:
    labels = [r["label"] for r in results_list]
    if len(set(labels)) < len(labels):  # two runs of one policy: tell them apart by folder
        labels = [f"{lab} ({n})" for lab, n in zip(labels, names or range(len(labels)))]
    return labels


def plot_accuracy(results_list: Sequence[dict[str, Any]], path: str | Path, names: Sequence[str] | None = None) -> Path:
    """``accuracy_vs_length.png``: sub_em and EM against paragraphs (log scale), one line per policy."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    ticks: set[float] = set()
    for results, label in zip(results_list, _labels(results_list, names)):
        rows = _length_rows(results)
        xs = [r["paragraphs"] for r in rows]
        ticks.update(xs)
        for ax, metric in zip(axes, ("sub_em", "em")):
            ax.plot(xs, [100 * (r["metrics"].get(metric) or 0.0) for r in rows], marker="o", label=label)
    for ax, title in zip(axes, ("sub_em (reference)", "exact match")):
        ax.set_xscale("log", base=2)
        if ticks:  # label the measured lengths themselves, not powers of two
            ax.set_xticks(sorted(ticks), [f"{int(t):,}" for t in sorted(ticks)])
            ax.minorticks_off()
        ax.set_xlabel("document length (paragraphs)")
        ax.set_ylabel(f"{title} (%)")
        ax.set_title(title)
        ax.set_ylim(-2, 102)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render_comparison_md(results_list: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """Side-by-side table of several evaluations (rows = lengths, columns = metric x policy)."""
    labels = _labels(results_list, names)
    lines = ["# Comparison", ""]
    lines += [
        f"- **{lab}**: `{n}` (policy `{r['policy']['spec']}`{', baseline ' + r['baseline'] if r.get('baseline') else ''})"
        for lab, n, r in zip(labels, names, results_list)
    ]
    header = ["paragraphs"] + [f"{_SHORT[m]}: {lab}" for m in ACCURACY_METRICS for lab in labels]
    by_len = [{r["paragraphs"]: r for r in _length_rows(res)} for res in results_list]
    lengths = sorted({p for d in by_len for p in d if p is not None})
    rows = []
    for n in lengths:
        rows.append(
            [_int(n)] + [_pct(d[n]["metrics"].get(m)) if n in d else "–" for m in ACCURACY_METRICS for d in by_len]
        )
    rows.append(
        ["**overall**"] + [_pct((res.get("overall") or {}).get(m)) for m in ACCURACY_METRICS for res in results_list]
    )
    lines += ["", "## Accuracy by length (%)", ""] + _table(header, rows)
    controls = sorted({c["variant"] for res in results_list for c in _control_rows(res)})
    if controls:
        by_var = [{c["variant"]: c for c in _control_rows(res)} for res in results_list]
        rows = [
            [v] + [_pct(d[v]["metrics"].get(m)) if v in d else "–" for m in ACCURACY_METRICS for d in by_var]
            for v in controls
        ]
        lines += ["", "## Robustness (%)", ""] + _table(["control"] + header[1:], rows)
    process = [
        ("turns", _num(2)),
        ("queries_per_turn", _num(2)),
        ("reader_calls", _num(1)),
        ("lead_prompt_tokens", _int),
        ("latency_p50_s", _num(2)),
        ("latency_p95_s", _num(2)),
        ("failed", _int),
    ]
    for res in results_list:  # e.g. HMARS's evidence metrics beside PARSER's process ones
        for key in get_protocol(res.get("protocol") or "parser").compare_metrics:
            if key not in dict(process):
                process.append((key, _FORMATS[key]))
    rows = [
        [lab] + [f((res.get("overall") or {}).get(k)) for k, f in process] for lab, res in zip(labels, results_list)
    ]
    lines += ["", "## Process (overall)", ""] + _table(["policy"] + [k for k, _ in process], rows)
    return "\n".join(lines) + "\n"


def compare_results(folders: Sequence[str | Path], out: str | Path) -> dict[str, Any]:
    """Write ``comparison.md``, ``comparison.json`` and ``accuracy_vs_length.png`` for several eval folders."""
    if len(folders) < 2:
        raise DataError("--compare needs at least two eval folders")
    results_list = [load_results(f) for f in folders]
    names = [str(f) for f in folders]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(render_comparison_md(results_list, names), encoding="utf-8")
    plot_accuracy(results_list, out / "accuracy_vs_length.png", names)
    labels = _labels(results_list, names)
    summary = {
        "runs": [
            {
                "folder": n,
                "label": lab,
                "overall": r.get("overall"),
                "by_length": {str(s["paragraphs"]): s["metrics"] for s in _length_rows(r)},
            }
            for n, lab, r in zip(names, labels, results_list)
        ]
    }
    (out / "comparison.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
