"""RetryPolicy (the one retry loop of every model client), in its sync and async forms, and the served
policy's requests that use it, against a loopback server."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from recording_server import RecordingServer

from coordrl.readers.retry import Fatal, Outcome, Retryable, RetryPolicy
from coordrl.rollout.models import WORLD_MODEL, resolve_model
from coordrl.rollout.openai_policy import OpenAIPolicy, PolicyRequestError

pytestmark = pytest.mark.timeout(60)


class Script:
    """An attempt function that fails as scripted (one item per call) and records when it was called."""

    def __init__(self, *steps: Exception | str) -> None:
        self.steps = list(steps)
        self.times: list[float] = []

    def __call__(self) -> str:
        self.times.append(time.perf_counter())
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    async def coro(self) -> str:
        return self()

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def _both(policy: RetryPolicy, script: Script, form: str) -> Outcome[str]:
    return policy.run(script) if form == "sync" else asyncio.run(policy.arun(script.coro))


@pytest.mark.parametrize("form", ["sync", "async"])
def test_retryable_failures_retry_with_doubling_backoff(form):
    script = Script(Retryable("HTTP 503: busy"), Retryable("timeout after 1s"), "answer")
    outcome = _both(RetryPolicy(retries=3, backoff_s=0.05), script, form)
    assert outcome == Outcome("answer", attempts=3)
    assert outcome.ok and not outcome.gave_up
    first, second = script.gaps()  # backoff_s, then doubled (upper bounds loose: a busy machine is slow)
    assert 0.05 <= first < 0.5 and 0.1 <= second < 0.6


@pytest.mark.parametrize("form", ["sync", "async"])
def test_budget_runs_out_with_the_last_error(form):
    script = Script(*(Retryable(f"HTTP 500: try {i}") for i in range(3)))
    outcome = _both(RetryPolicy(retries=2, backoff_s=0.0), script, form)
    assert outcome == Outcome(None, attempts=3, error="HTTP 500: try 2", gave_up=True)
    assert not outcome.ok


@pytest.mark.parametrize("form", ["sync", "async"])
def test_fatal_failure_stops_at_once(form):
    script = Script(Retryable("HTTP 429: slow down"), Fatal("HTTP 400: bad request"), "never reached")
    outcome = _both(RetryPolicy(retries=5, backoff_s=0.0), script, form)
    assert outcome == Outcome(None, attempts=2, error="HTTP 400: bad request", gave_up=False)
    assert script.steps == ["never reached"]


@pytest.mark.parametrize("form", ["sync", "async"])
def test_other_exceptions_propagate_untouched(form):
    error = KeyError("not a transport failure")
    script = Script(Retryable("refused"), error, "never reached")
    with pytest.raises(KeyError) as info:
        _both(RetryPolicy(retries=3, backoff_s=0.0), script, form)
    assert info.value is error and len(script.times) == 2


def test_no_retries_means_one_attempt():
    outcome = RetryPolicy(retries=0, backoff_s=10.0).run(Script(Retryable("down")))
    assert outcome == Outcome(None, attempts=1, error="down", gave_up=True)


def test_async_backoff_does_not_block_the_loop():
    async def go() -> tuple[Outcome[str], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        outcome = await RetryPolicy(retries=1, backoff_s=0.2).arun(Script(Retryable("down"), "up").coro)
        task.cancel()
        return outcome, ticks

    outcome, ticks = asyncio.run(go())
    assert outcome.value == "up" and ticks >= 10


def test_delays_worst_case_and_validation():
    policy = RetryPolicy(retries=3, backoff_s=0.5)
    assert [policy.delay_s(n) for n in range(4)] == [0.0, 0.5, 1.0, 2.0]
    assert policy.attempts == 4
    assert policy.worst_case_s(120) == 120 * 4 + 0.5 * 7  # the plan's reader round at the defaults
    with pytest.raises(ValueError, match="retries must be >= 0"):
        RetryPolicy(retries=-1, backoff_s=0.5)
    with pytest.raises(ValueError, match="backoff_s must be >= 0"):
        RetryPolicy(retries=1, backoff_s=-0.1)


# -- the served policy's requests ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(WORLD_MODEL))


def _policy(url: str, tokenizer, **kw) -> OpenAIPolicy:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return OpenAIPolicy(url, "recorded", tokenizer, api_key_env=None, **kw)


def test_policy_retries_server_errors_then_gives_up_with_the_count(tokenizer):
    with RecordingServer(policy_responder=lambda body: [1, 2]) as server:
        server.faults["policy"] = "http500"
        policy = _policy(server.url, tokenizer, max_retries=2)
        with pytest.raises(PolicyRequestError) as info:
            policy.generate([5, 6, 7])
        assert len(server.bodies("policy")) == 3
        assert str(info.value) == (
            f'POST {server.url}/v1/completions failed after 3 attempt(s): HTTP 500: {{"error": "injected"}}'
        )
        del server.faults["policy"]
        assert policy.generate([5, 6, 7]) == [1, 2, tokenizer.eos_token_id]


@pytest.mark.parametrize(
    ("fault", "message"),
    [("http400", 'failed: HTTP 400: {"error": "injected"}'), ("not_json", "reply is not JSON: <html>not json</html>")],
)
def test_policy_client_errors_are_not_retried(tokenizer, fault, message):
    with RecordingServer(policy_responder=lambda body: [1]) as server:
        server.faults["policy"] = fault
        with pytest.raises(PolicyRequestError, match=message):
            _policy(server.url, tokenizer, max_retries=3).generate([5])
        assert len(server.bodies("policy")) == 1


def test_policy_gives_up_on_a_refused_connection(tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PolicyRequestError, match=r"failed after 2 attempt\(s\): ConnectError: "):
        _policy(f"http://127.0.0.1:{port}", tokenizer, max_retries=1).generate([5])
