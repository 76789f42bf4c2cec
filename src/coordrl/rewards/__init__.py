"""Answer extraction, HotpotQA normalisation and the exact-match family of metrics and rewards."""

from coordrl.rewards.extract import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    ends_with_stop,
    extract_answer,
    final_answer_message,
)
from coordrl.rewards.metrics import (
    exact_match,
    f1_score,
    guarded_sub_em,
    normalize_answer,
    score_prediction,
    sub_em,
)
from coordrl.rewards.reward import exact_match_reward, f1_reward

__all__ = [
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "ends_with_stop",
    "exact_match",
    "exact_match_reward",
    "extract_answer",
    "f1_reward",
    "f1_score",
    "final_answer_message",
    "guarded_sub_em",
    "normalize_answer",
    "score_prediction",
    "sub_em",
]
