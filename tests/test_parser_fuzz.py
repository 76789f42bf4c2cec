"""Fuzz: random and adversarial tool-call payloads never crash the environment or the step API."""

import asyncio
import json
import random


from coordrl.data.tokens import load_tokenizer
from coordrl.envs.chat import ChatCodec
from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory
from coordrl.envs.step import StepEnv

SPECIAL = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<answer>", "</answer>", "<|endoftext|>"]
DOC = "\n\n".join(f"Document {i}:\nTitle {i}\nTitle {i} was founded in {1900 + i} by Person {i} in City {i % 5}." for i in range(1, 40))


def rand_scalar(rng):
    return rng.choice([
        None, True, False, rng.randint(-10**12, 10**12), rng.random() * 1e6, float("nan") if rng.random() < 0.1 else 0.5,
        "", " ", rng.choice(SPECIAL), "x" * rng.randint(0, 3000), "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(1, 20)) if not 0xD800 <= rng.randint(0, 0x10FFFF) <= 0xDFFF),
        "Who founded Title 3?", "\x00\x01\n\t", "{\"queries\": []}", "Title 7",
    ])


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
        args = {"queries": ["Who founded Title %d?" % rng.randint(1, 40) for _ in range(rng.randint(1, 8))]}
    elif kind == 4:
        args = {"query": "wrong name", "extra": 1}
    else:
        args = {"queries": [safe_text(str(rand_scalar(rng)))]}
    name = rng.choice(["query_agents"] * 6 + ["reset", "get_reward", "_validate", "info", "", "nope", "query_agents ", None, 5])
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
    row = {"id": "fuzz", "question": "Who founded Title 3?", "context": DOC, "answers": ["Person 3"], "gold_documents": [3]}
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
