"""Fuzz: random and adversarial tool-call payloads never crash the environment or the step API.

Over 5,000 seeded payloads in all: random JSON, and the hostile families (lone surrogates, deep
nesting, huge and non-finite numbers, objects whose ``str`` fails) through ``query_agents``,
``broadcast`` and `StepEnv.step`. Each family test reports how many payloads let an exception
escape (must be 0) and checks that every refusal and failure was counted.
"""

import asyncio
import json
import random

from coordrl.data.tokens import load_tokenizer
from coordrl.envs.chat import ChatCodec
from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory
from coordrl.envs.step import StepEnv

SPECIAL = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<|endoftext|>",
]
DOC = "\n\n".join(
    f"Document {i}:\nTitle {i}\nTitle {i} was founded in {1900 + i} by Person {i} in City {i % 5}."
    for i in range(1, 40)
)


def rand_scalar(rng):
    return rng.choice(
        [
            None,
            True,
            False,
            rng.randint(-(10**12), 10**12),
            rng.random() * 1e6,
            float("nan") if rng.random() < 0.1 else 0.5,
            "",
            " ",
            rng.choice(SPECIAL),
            "x" * rng.randint(0, 3000),
            "".join(
                chr(rng.randint(0, 0x10FFFF))
                for _ in range(rng.randint(1, 20))
                if not 0xD800 <= rng.randint(0, 0x10FFFF) <= 0xDFFF
            ),
            "Who founded Title 3?",
            "\x00\x01\n\t",
            '{"queries": []}',
            "Title 7",
        ]
    )


def rand_value(rng, depth=0):
    if depth > 3 or rng.random() < 0.5:
        return rand_scalar(rng)
    if rng.random() < 0.5:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 12))]
    return {str(rand_scalar(rng))[:20]: rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def safe_text(s: str) -> str:
    return s.encode("utf-8", "replace").decode("utf-8")


def payload(rng) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        args = {"queries": rand_value(rng)}
    elif kind == 1:
        args = rand_value(rng)
    elif kind == 2:
        args = {"queries": [rand_scalar(rng) for _ in range(rng.randint(0, 20))]}
    elif kind == 3:
        args = {"queries": [f"Who founded Title {rng.randint(1, 40)}?" for _ in range(rng.randint(1, 8))]}
    elif kind == 4:
        args = {"query": "wrong name", "extra": 1}
    else:
        args = {"queries": [safe_text(str(rand_scalar(rng)))]}
    name = rng.choice(
        ["query_agents"] * 6 + ["reset", "get_reward", "_validate", "info", "", "nope", "query_agents ", None, 5]
    )
    body = {"name": name, "arguments": args}
    if rng.random() < 0.1:
        body = rand_value(rng)
    try:
        text = json.dumps(body, ensure_ascii=rng.random() < 0.5, allow_nan=True)
    except (TypeError, ValueError):
        text = str(body)
    text = safe_text(text)
    mangle = rng.randrange(10)
    if mangle == 0:
        text = text[: rng.randint(0, len(text))]  # truncated JSON
    elif mangle == 1:
        text = text.replace('"', "'")
    out = f"<tool_call>\n{text}\n</tool_call>"
    if rng.random() < 0.2:
        out = out * rng.randint(2, 4)  # several calls in one turn
    if rng.random() < 0.1:
        out = rng.choice(SPECIAL) + out + rng.choice(SPECIAL)
    if rng.random() < 0.05:
        out = "<answer>" + safe_text(str(rand_scalar(rng))) + "</answer>"
    return out


def test_step_api_survives_1000_random_and_adversarial_payloads():
    tok = load_tokenizer(None)
    factory = ParserEnvFactory(ParserEnvConfig(max_turns=9, observation_max_tokens=256), tokenizer=tok)
    env = StepEnv(factory(), ChatCodec(tok), max_turns=9)
    rng = random.Random(1234)
    row = {
        "id": "fuzz",
        "question": "Who founded Title 3?",
        "context": DOC,
        "answers": ["Person 3"],
        "gold_documents": [3],
    }
    steps = episodes = 0
    env.reset(**row)
    for _ in range(1200):
        if env.done or len(env.completion_ids) > 6000:
            env.reset(**row)
            episodes += 1
        step = env.step(payload(rng))
        steps += 1
        assert isinstance(step.reward, float) and step.reward in (0.0, 1.0)
        assert step.observation is None or isinstance(step.observation, str)
        assert isinstance(step.info["tool_errors"], int)
    assert steps == 1200 and episodes > 50


def test_direct_tool_calls_survive_random_arguments():
    tok = load_tokenizer(None)
    env = ParserEnvFactory(ParserEnvConfig(observation_max_tokens=128), tokenizer=tok)()
    env.reset(question="q", context=DOC)
    rng = random.Random(99)

    async def run_all():
        outs = []
        for _ in range(600):
            outs.append(await env.query_agents(rand_value(rng)))
        return outs

    outs = asyncio.run(run_all())
    assert all(isinstance(o, str) for o in outs)
    assert env.info["tool_errors"] > 100


# -- hostile payload families: lone surrogates, deep nesting, huge numbers, objects whose str fails --
#
# Every payload goes through the public entry point; an exception escaping it is recorded (not
# raised at once) so a failure reports how many of the payloads escaped and which.


class BrokenStr:
    """An argument object whose ``str`` and ``repr`` raise."""

    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


class BrokenList(list):
    """A list whose length and iteration raise."""

    def __len__(self):
        raise RuntimeError("no len")

    def __iter__(self):
        raise RuntimeError("no iter")


class BrokenStrSubclass(str):
    """A string whose overridden methods raise; the environment must not call them."""

    def split(self, *a, **k):
        raise RuntimeError("no split")

    def __str__(self):
        raise RuntimeError("no str")


class BrokenDict(dict):
    def items(self):
        raise RuntimeError("no items")


HUGE_INT = 10**5000 - 1  # str() raises ValueError (over Python's 4,300-digit limit)


def with_surrogate(rng, base: str = "Who founded Title 3?") -> str:
    pos = rng.randint(0, len(base))
    return base[:pos] + chr(rng.randint(0xD800, 0xDFFF)) + base[pos:]


def deep(rng, depth: int | None = None):
    value: object = "Who founded Title 3?"
    for _ in range(depth if depth is not None else rng.choice([33, 200, 999, 1200, 5000])):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def hostile_value(rng):
    """One value of a hostile family (Python objects, for direct tool calls)."""
    family = rng.randrange(4)
    if family == 0:
        return with_surrogate(rng)
    if family == 1:
        return deep(rng)
    if family == 2:
        return rng.choice([HUGE_INT, -HUGE_INT, float("inf"), float("-inf"), float("nan"), 2**64, 1e308, -0.0])
    return rng.choice([BrokenStr(), BrokenList(["q"]), BrokenStrSubclass("Who founded Title 3?"), BrokenDict(s0="x")])


def hostile_queries(rng):
    shape = rng.randrange(3)
    if shape == 0:
        return hostile_value(rng)
    if shape == 1:
        return [hostile_value(rng)]
    return [f"Who founded Title {rng.randint(1, 40)}?" for _ in range(rng.randint(0, 3))] + [hostile_value(rng)]


def count_errors(observations: list[str]) -> int:
    return sum(o.startswith("Error: ") for o in observations)


def test_query_agents_survives_hostile_families():
    tok = load_tokenizer(None)
    env = ParserEnvFactory(ParserEnvConfig(observation_max_tokens=128), tokenizer=tok)()
    env.reset(question="q", context=DOC)
    rng = random.Random(7)
    escaped: list[str] = []
    observations: list[str] = []

    async def run_all():
        for _ in range(900):
            queries = hostile_queries(rng)
            try:
                observations.append(await env.query_agents(queries))
            except Exception as exc:
                escaped.append(f"{type(exc).__name__}: {exc}"[:200])

    asyncio.run(run_all())
    assert not escaped, f"{len(escaped)} of 900 payloads escaped, e.g. {escaped[:3]}"
    assert all(isinstance(o, str) for o in observations)
    kinds = env.tool_error_kinds
    assert sum(kinds.values()) == count_errors(observations) == env.info["tool_errors"]  # every refusal counted
    assert kinds["unencodable"] > 50 and kinds["wrong_type"] > 50 and kinds["unreadable"] > 10, kinds
    assert any("lone surrogate" in o for o in observations)


def hmars_factory(tok):
    from coordrl.envs.hmars import HmarsEnvConfig, HmarsEnvFactory

    return HmarsEnvFactory(HmarsEnvConfig(c_sub=256, page_tokens=64, group_size=4), tokenizer=tok)


def test_broadcast_survives_hostile_families():
    tok = load_tokenizer(None)
    factory = hmars_factory(tok)
    row = {"id": "fuzz", "question": "Who founded Title 3?", "context": DOC, "answers": ["Person 3"]}
    rng = random.Random(11)
    escaped: list[str] = []
    observations: list[str] = []
    counted = 0

    async def one(env, interpretation, hints):
        return await env.broadcast(interpretation, hints)

    for _ in range(900):
        env = factory()
        env.reset(**row)
        slot = rng.randrange(4)
        interpretation = hostile_value(rng) if slot == 0 else "Title 3 founder"
        if slot == 1:
            hints = hostile_value(rng)
        elif slot == 2:
            hints = {"s0": hostile_value(rng)}
        else:
            key = rng.choice(
                [
                    BrokenStr(),
                    BrokenStrSubclass("s0"),
                    HUGE_INT,
                    -HUGE_INT,
                    float("nan"),
                    0,
                    True,
                    with_surrogate(rng, "s0"),
                    (1, 2),
                ]
            )
            hints = {key: "founder"}
        try:
            obs = asyncio.run(one(env, interpretation, hints))
        except Exception as exc:
            escaped.append(f"{type(exc).__name__}: {exc}"[:200])
            continue
        observations.append(obs)
        counted += env.info["tool_errors"]
    factory.close()
    assert not escaped, f"{len(escaped)} of 900 payloads escaped, e.g. {escaped[:3]}"
    assert counted == count_errors(observations) > 700  # every refusal counted by the environment
    assert any("lone surrogate" in o for o in observations)


def hostile_turn(rng) -> str:
    """Assistant text carrying a hostile family, as a policy could write it."""
    family = rng.randrange(5)
    if family == 0:  # a lone surrogate spelled as a JSON escape: json.loads produces it
        escape = f"\\ud{rng.randint(0x800, 0xFFF):03x}"
        return f'<tool_call>\n{{"name": "query_agents", "arguments": {{"queries": ["Who founded {escape} Title 3?"]}}}}\n</tool_call>'
    if family == 1:  # a raw lone surrogate in the text itself
        return with_surrogate(
            rng,
            rng.choice(
                [
                    "<answer>Person 3</answer>",
                    '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["Who founded Title 3?"]}}\n</tool_call>',
                ]
            ),
        )
    if family == 2:  # deep nesting inside a tool call (or in plain text, which is harmless)
        depth = rng.choice([31, 33, 200, 999, 1200, 5000])
        nest = "[" * depth + '"q"' + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
        inner = f'{{"name": "query_agents", "arguments": {{"queries": {nest}}}}}'
        if rng.random() < 0.3:
            inner = inner[: rng.randint(1, len(inner))]  # truncated
        return f"<tool_call>\n{inner}\n</tool_call>" if rng.random() < 0.9 else nest
    if family == 3:  # huge and non-finite numbers
        number = rng.choice(
            ["9" * 5000, "1e999", "-1e999", "NaN", "Infinity", "-0", "18446744073709551616", "1" + "0" * 400]
        )
        arguments = rng.choice([f'{{"queries": [{number}]}}', f'{{"queries": {number}}}', f'{{"{number}": 1}}', number])
        return f'<tool_call>\n{{"name": "query_agents", "arguments": {arguments}}}\n</tool_call>'
    # a tool name or argument key that UTF-8 cannot encode
    return '<tool_call>\n{"name": "query\\ud800agents", "arguments": {"qu\\udfffeeries": ["x"]}}\n</tool_call>'


def check_step(env: StepEnv, before: dict, step, turn: str) -> None:
    """Every failure of this step is counted: refusals by the environment, tool failures by the
    tool loop, unparseable calls and repaired text by StepEnv."""
    info = step.info
    tool_msgs = env.completion[len(before["completion"]) :][1:]
    errors = sum(str(m["content"]).startswith("Error: ") for m in tool_msgs)
    failures = sum(str(m["content"]).startswith("{'error'") for m in tool_msgs)
    assert info["tool_errors"] - before["tool_errors"] == errors
    assert info["tool_failures"] - before["tool_failures"] == failures
    last = env.completion[len(before["completion"])]
    unparsed = not last.get("tool_calls") and "<tool_call>" in str(last.get("content"))
    assert info["malformed_tool_calls"] - before["malformed_tool_calls"] == int(unparsed)
    has_surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in turn)
    assert info["invalid_text_turns"] - before["invalid_text_turns"] == int(has_surrogate)


COUNTERS = ("tool_errors", "tool_failures", "malformed_tool_calls", "invalid_text_turns")


def run_step_fuzz(env: StepEnv, row: dict, turns, seed: int, n: int) -> tuple[list[str], dict[str, int]]:
    """Step ``n`` turns from ``turns(rng)``, resetting when an episode ends; returns the escaped
    exceptions and the counters summed over all episodes."""
    rng = random.Random(seed)
    escaped: list[str] = []
    totals = dict.fromkeys((*COUNTERS, "unencodable"), 0)

    def tally():
        for key in COUNTERS:
            totals[key] += env.info[key]
        totals["unencodable"] += env.env.tool_error_kinds.get("unencodable", 0)

    env.reset(**row)
    for _ in range(n):
        if env.done or len(env.completion_ids) > 6000:
            tally()
            env.reset(**row)
        turn = turns(rng)
        before = {**{k: env.info[k] for k in COUNTERS}, "completion": list(env.completion)}
        try:
            step = env.step(turn)
        except Exception as exc:
            escaped.append(f"{type(exc).__name__}: {exc}"[:200])
            env.done = True
            continue
        check_step(env, before, step, turn)
    tally()
    return escaped, totals


def test_step_api_survives_hostile_families():
    tok = load_tokenizer(None)
    factory = ParserEnvFactory(ParserEnvConfig(max_turns=9, observation_max_tokens=256), tokenizer=tok)
    env = StepEnv(factory(), ChatCodec(tok), max_turns=9)
    row = {
        "id": "fuzz",
        "question": "Who founded Title 3?",
        "context": DOC,
        "answers": ["Person 3"],
        "gold_documents": [3],
    }
    escaped, totals = run_step_fuzz(env, row, hostile_turn, seed=5, n=1200)
    assert not escaped, f"{len(escaped)} of 1200 payloads escaped, e.g. {escaped[:3]}"
    assert totals["unencodable"] > 50 and totals["malformed_tool_calls"] > 100 and totals["invalid_text_turns"] > 50, (
        totals
    )
    assert totals["tool_failures"] > 50, totals  # unknown (unencodable) tool names and argument keys


def test_step_api_drives_broadcast_through_hostile_families():
    tok = load_tokenizer(None)
    factory = hmars_factory(tok)
    env = StepEnv(factory(), ChatCodec(tok), max_turns=2, reward_fn=lambda completions, **kw: [0.0], require_stop=False)

    def turns(rng) -> str:
        # The hostile value of each family lands in the interpretation, the hints, or one hint.
        text = hostile_turn(rng).replace('"query_agents"', '"broadcast"')
        if rng.random() < 0.7:  # a string where query_agents wants a list of strings
            text = text.replace('["Who founded', '"Who founded').replace('Title 3?"]', 'Title 3?"')
        slot = rng.randrange(3)
        if slot == 0:
            return text.replace('{"queries": ', '{"hints": {}, "interpretation": ')
        if slot == 1:
            return text.replace('{"queries": ', '{"interpretation": "Title 3", "hints": ')
        return text.replace('{"queries": ', '{"interpretation": "Title 3", "hints": {"s0": ').replace(
            "}}\n</tool_call>", "}}}\n</tool_call>"
        )

    row = {"id": "fuzz", "question": "Who founded Title 3?", "context": DOC, "answers": ["Person 3"]}
    escaped, totals = run_step_fuzz(env, row, turns, seed=3, n=300)
    factory.close()
    assert not escaped, f"{len(escaped)} of 300 payloads escaped, e.g. {escaped[:3]}"
    assert totals["unencodable"] > 5 and totals["malformed_tool_calls"] > 20, totals


def test_tool_call_depth_scan_reads_json_strings():
    from coordrl.envs.tool_input import tool_call_too_deep

    call = '<tool_call>{"name": "query_agents", "arguments": {"queries": [%s]}}</tool_call>'
    assert not tool_call_too_deep(call % '"' + "[" * 500 + '"')  # brackets inside a string do not nest
    assert not tool_call_too_deep(call % '"\\"' + "[" * 500 + '"')  # nor after an escaped quote
    assert tool_call_too_deep(call % ("[" * 40 + "]" * 40))
    assert not tool_call_too_deep(call % ("[" * 28 + "]" * 28))  # 3 + 28 levels: within 32
    assert tool_call_too_deep("<tool_call>" + "[" * 40)  # unclosed call: scanned to the end
    assert not tool_call_too_deep("[" * 5000)  # outside a tool call nothing is parsed


def test_a_tool_call_with_a_lone_surrogate_is_traced(tmp_path):
    from coordrl.eval.traces import TraceWriter, read_traces
    from coordrl.train.reward import EpisodeReward

    tok = load_tokenizer(None)
    factory = ParserEnvFactory(ParserEnvConfig(), tokenizer=tok)
    env = StepEnv(factory(), ChatCodec(tok), max_turns=3)
    env.reset(id="s1", question="Who founded Title 3?", context=DOC, answers=["Person 3"])
    step = env.step(
        '<tool_call>\n{"name": "query_agents", "arguments": {"queries": ["Title \\ud800 3"]}}\n</tool_call>'
    )
    assert step.observation.startswith("Error: query 1 holds a character that is not valid Unicode")
    env.step("<answer>Person 3</answer>")
    factory.close()
    query = env.completion[0]["tool_calls"][0]["function"]["arguments"]["queries"][0]
    assert query == "Title \ud800 3"  # what the policy sent, kept as sent
    TraceWriter(tmp_path / "eval").write("subset", {"id": "s1", "messages": env.completion})
    traced = read_traces(tmp_path / "eval" / "subset.jsonl")["s1"]["messages"]
    assert traced[0]["tool_calls"][0]["function"]["arguments"]["queries"][0] == query  # round-trips
    EpisodeReward(trace_dir=tmp_path / "train")([env.completion], answers=[["Person 3"]])
    line = json.loads((tmp_path / "train" / "rank0.jsonl").read_text(encoding="utf-8"))
    assert line["completion"][0]["tool_calls"][0]["function"]["arguments"]["queries"][0] == query


def test_selector_replies_with_hostile_numbers_and_nesting_parse_or_fall_back():
    from coordrl.envs.hmars import HmarsEnvConfig
    from coordrl.envs.hmars_roles import Backends

    backends = Backends(HmarsEnvConfig())  # lexical roles: nothing is served, only the reply parser runs
    allowed = {3, 4, 5}
    replies = [
        '{"pages": [{"id": 3, "confidence": ' + "9" * 400 + "}]}",  # an int too large for a float
        '{"pages": [{"id": 3, "confidence": 1e999}, {"id": 4, "confidence": NaN}, {"id": 5, "confidence": 0.5}]}',
        '{"pages": [{"id": ' + "9" * 4000 + '}, {"id": "p4"}, {"id": [3]}, {"id": {"a": 3}}, {"id": true}]}',
        '{"pages": [' + "[" * 900 + "3" + "]" * 900 + ", 5]}",  # deep, but within the decoder's reach
        '{"pages": [' + "[" * 5000 + "3" + "]" * 5000 + "]}",  # RecursionError in the decoder
        '{"pages": [{"id": "' + "9" * 5000 + '"}, {"id": 4.0}, {"id": -3}]}',
    ]
    parsed = [backends._parse_selection(r, allowed) for r in replies]
    assert parsed[0] == ([3], {3: 1.0})
    assert parsed[1] == ([3, 4], {3: 1.0, 4: 1.0})  # non-finite confidences count as 1.0, ties by id
    assert parsed[2] == ([4], {4: 1.0})
    assert parsed[3] == ([5], {5: 1.0})
    assert parsed[4] is None  # unparseable: the caller counts it and selects lexically
    assert parsed[5] == ([], {})


def test_tool_call_depth_scan_is_linear_and_sees_every_call():
    from coordrl.envs.tool_input import tool_call_too_deep

    # Thousands of unclosed openers and brackets: one scan, not one per opener.
    assert not tool_call_too_deep("<tool_call>[]" * 20_000)
    assert tool_call_too_deep(
        '<tool_call>{"a": 1}</tool_call>\n<tool_call>' + "[" * 40 + "]" * 40 + "</tool_call>"
    )  # the second call
    assert not tool_call_too_deep("<tool_call>[[[]]]</tool_call>" + "[" * 40)  # after the last call nothing is parsed
