"""Answer extraction, HotpotQA normalisation and the exact-match family of metrics and rewards."""

from coordrl.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN, extract_answer, final_answer_message
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
    "ANSWER_OPEN",
    "ANSWER_CLOSE",
    "extract_answer",
    "final_answer_message",
    "normalize_answer",
    "exact_match",
    "f1_score",
    "sub_em",
    "guarded_sub_em",
    "score_prediction",
    "exact_match_reward",
    "f1_reward",
]
