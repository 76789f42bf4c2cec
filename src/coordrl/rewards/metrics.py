"""HotpotQA answer normalisation and the metrics reported by coordrl (and their latency percentiles).

`sub_em` reproduces the reference evaluation used by MemAgent and PARSER (bidirectional substring
match after normalisation) so our numbers compare with the published ones. The reference scores
the first gold answer; HotpotQA and 2WikiMultiHopQA have exactly one, and MuSiQue's answer aliases
(the later gold answers) are accepted too, as by every metric here. It leaks: a prediction that normalises to "" matches everything, "no" matches
"November", "1" matches "1990". `guarded_sub_em` closes the first leak; EM and token F1 are strict.
Report all of them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """HotpotQA normalisation: lower-case, drop punctuation, drop articles a/an/the, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_list(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer; None scores 0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_list(golds)))


def _f1(pred: str, gold: str) -> float:
    pred_norm, gold_norm = normalize_answer(pred), normalize_answer(gold)
    # yes/no/noanswer are scored all-or-nothing in the official HotpotQA evaluation.
    special = {"yes", "no", "noanswer"}
    if (pred_norm in special or gold_norm in special) and pred_norm != gold_norm:
        return 0.0
    pred_tokens, gold_tokens = pred_norm.split(), gold_norm.split()
    common = Counter(pred_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Token F1 as in the official HotpotQA evaluation, maximised over gold answers."""
    if prediction is None:
        return 0.0
    return max((_f1(prediction, g) for g in _as_list(golds)), default=0.0)


def sub_em(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Reference-compatible bidirectional substring match against any gold answer (the reference's
    single answer, or an alias).

    Kept leaky on purpose (see module docstring) so that results compare with published numbers.
    A missing prediction (None) scores 0, as in the reference.
    """
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(gold in pred or pred in gold for gold in map(normalize_answer, _as_list(golds))))


def guarded_sub_em(prediction: str | None, golds: str | Sequence[str]) -> float:
    """`sub_em` where a prediction that normalises to the empty string scores 0."""
    if prediction is None or not normalize_answer(prediction):
        return 0.0
    return sub_em(prediction, golds)


def score_prediction(prediction: str | None, golds: str | Sequence[str]) -> dict[str, float]:
    """All metrics for one prediction: ``{"em", "f1", "sub_em", "guarded_sub_em"}``."""
    return {
        "em": exact_match(prediction, golds),
        "f1": f1_score(prediction, golds),
        "sub_em": sub_em(prediction, golds),
        "guarded_sub_em": guarded_sub_em(prediction, golds),
    }


def nearest_rank_percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (0-100) by nearest rank: the smallest value with at least p% of the values at or
    below it, always one of the values (no interpolation); None for no values.

    Nearest rank (numpy's ``inverted_cdf``) rather than numpy's default linear interpolation, so the latency
    percentiles in traces and reports keep the figures coordrl has always reported.
    """
    if len(values) == 0:
        return None
    # .item(): a Python scalar of the values' own kind, so the figure serialises to JSON like the inputs do.
    return np.percentile(values, p, method="inverted_cdf").item()
