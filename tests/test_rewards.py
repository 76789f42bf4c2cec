import pytest

from coordrl.rewards import (
    exact_match,
    exact_match_reward,
    extract_answer,
    f1_reward,
    f1_score,
    guarded_sub_em,
    normalize_answer,
    score_prediction,
    sub_em,
)


def test_normalize_answer_hotpotqa_rules():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("  ") == ""


@pytest.mark.parametrize(
    ("pred", "gold", "em", "sub", "guarded"),
    [
        ("no", "November", 0.0, 1.0, 1.0),  # reference leak kept in sub_em, EM is strict
        ("1", "1990", 0.0, 1.0, 1.0),
        ("The", "Paris", 0.0, 1.0, 0.0),  # normalises to "": reference scores 1, guarded 0
        ("", "Paris", 0.0, 1.0, 0.0),
        ("the Paris", "Paris", 1.0, 1.0, 1.0),
        ("London", "Paris", 0.0, 0.0, 0.0),
    ],
)
def test_known_leaks(pred, gold, em, sub, guarded):
    assert exact_match(pred, gold) == em
    assert sub_em(pred, gold) == sub
    assert guarded_sub_em(pred, gold) == guarded


def test_every_metric_accepts_any_gold_answer_and_none_scores_zero():
    # MuSiQue's answer aliases are later gold answers: an alias scores like the answer itself.
    golds = ["Paris", "City of Light"]
    assert score_prediction("the city of light", golds) == {"em": 1.0, "f1": 1.0, "sub_em": 1.0, "guarded_sub_em": 1.0}
    assert sub_em("Lyon", ["Paris", "Lyon"]) == 1.0 and sub_em("Lyon", ["Paris", "Marseille"]) == 0.0
    assert exact_match_reward([[_assistant("<answer>City of Light</answer>")]], answers=[golds]) == [1.0]
    assert score_prediction(None, "Paris") == {"em": 0.0, "f1": 0.0, "sub_em": 0.0, "guarded_sub_em": 0.0}


def test_f1():
    assert f1_score("Barack Obama", "Obama") == pytest.approx(2 / 3)
    assert f1_score("yes", "no") == 0.0
    assert f1_score("no", "no") == 1.0


def _assistant(text, tool_calls=None):
    msg = {"role": "assistant", "content": text}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


CALL = [{"type": "function", "function": {"name": "query_agents", "arguments": {"queries": ["x"]}}}]


def test_extract_answer_from_final_assistant_message():
    conv = [
        _assistant("", CALL),
        {"role": "tool", "name": "query_agents", "content": "found"},
        _assistant("<think>hm</think>So <answer> Paris </answer>"),
    ]
    assert extract_answer(conv) == "Paris"
    assert extract_answer("<answer>a</answer> then <answer>b</answer>") == "b"
    assert extract_answer("<think><answer>x</answer></think>no tag") is None


def test_rollouts_that_did_not_answer_score_zero():
    ends_on_tool = [_assistant("<answer>Paris</answer>", CALL), {"role": "tool", "content": "r"}]
    ends_on_call = [_assistant("<answer>Paris</answer>", CALL)]
    raw_call = [_assistant('<answer>Paris</answer><tool_call>{"name": "query_agents"</tool_call>')]
    for conv in (ends_on_tool, ends_on_call, raw_call, []):
        assert extract_answer(conv) is None
    rewards = exact_match_reward(
        [ends_on_tool, ends_on_call, [_assistant("<answer>paris</answer>")]], answers=[["Paris"]] * 3
    )
    assert rewards == [0.0, 0.0, 1.0]


def test_reward_columns_and_errors():
    assert exact_match_reward(["<answer>yes</answer>"], answer=["yes"]) == [1.0]
    assert f1_reward(["<answer>Barack Obama</answer>"], answers=[["Obama"]]) == [pytest.approx(2 / 3)]
    with pytest.raises(ValueError, match="answers"):
        exact_match_reward(["<answer>yes</answer>"])
    with pytest.raises(ValueError, match="1 completions but 2"):
        exact_match_reward(["<answer>yes</answer>"], answers=[["yes"], ["no"]])


def test_training_reward_scores_cut_off_rollouts_zero():
    """EpisodeReward with an EOS id: a rollout whose completion ids do not end with EOS (its final turn
    hit a token cap) scores 0 even with the right answer in its text, and the share is logged."""
    from coordrl.train.reward import EpisodeReward

    eos = 7
    completions = [[{"role": "assistant", "content": "<answer>Paris</answer>"}]] * 3
    ids = [[1, 2, eos], [1, 2, 3], []]
    logged = {}
    reward = EpisodeReward(eos_token_id=eos)
    out = reward(completions, answers=[["Paris"]] * 3, completion_ids=ids, log_metric=logged.__setitem__)
    assert out == [1.0, 0.0, 0.0]
    assert logged["env/unfinished"] == 2 / 3
    assert EpisodeReward()(completions, answers=[["Paris"]] * 3, completion_ids=ids) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([], 50, None),
        ([7.0], 95, 7.0),
        ([4.0, 1.0, 3.0, 2.0], 50, 2.0),  # nearest rank: the 2nd of 4, not the interpolated 2.5
        ([4.0, 1.0, 3.0, 2.0], 95, 4.0),
        ([float(i) for i in range(1, 21)], 95, 19.0),  # 0.95 x 20 = 19: exactly the 19th value
        ([float(i) for i in range(1, 101)], 50, 50.0),
        ([float(i) for i in range(1, 101)], 95, 95.0),
        ([0.2, 0.9, 0.4], 0, 0.2),
        ([0.2, 0.9, 0.4], 100, 0.9),
        ([3, 1, 2], 50, 2),  # ints stay ints (JSON-serialisable Python scalars)
    ],
)
def test_nearest_rank_percentile(values, p, expected):
    from coordrl.rewards.metrics import nearest_rank_percentile

    got = nearest_rank_percentile(values, p)
    assert got == expected and type(got) is type(expected)
