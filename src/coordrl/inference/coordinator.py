"""The inference API: answer a question about a raw document with a trained coordinator.

    from coordrl.inference.coordinator import Coordinator

    coord = Coordinator.from_pretrained("exports/parser-4b", readers="lexical")
    result = coord.answer(document_text, "Who directed the film?")
    result.answer, result.evidence, result.trace

The document is wrapped and chunked by the same environment that training and evaluation use
(`ParserLeadEnv.reset(context=document)`), episodes run through the same `StepEnv` loop, and the
policy runs in-process with transformers or on an OpenAI-compatible server (``policy_url``, e.g.
``vllm serve <export>``) through `OpenAIPolicy` with token-id prompts, so it sees the tokens it was
trained on. Evaluation settings apply by default: 4,096-token reader chunks and 12 tool rounds.

An ``hmars`` policy (HMARS mid-agent) is answered by `coordrl.envs.hmars.answer_all_regions`: the
document is indexed into sub-agent regions and pages (settings recorded at training, overridable
with ``hmars={...}``), the policy broadcasts once for each of the K mid-agent regions concurrently
(each through its own `StepEnv`), and the answer model answers once from the merged pages.

``coordrl answer --policy DIR --document FILE --question TEXT`` is the command-line form.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Self

from coordrl.data.errors import DataError
from coordrl.data.tokens import count_tokens_up_to, max_chars_per_token
from coordrl.envs.chat import ChatCodec
from coordrl.envs.hmars import answer_all_regions
from coordrl.envs.protocols import get_protocol
from coordrl.envs.step import StepEnv
from coordrl.readers.fleet import make_fleet
from coordrl.rollout.episode import run_episode
from coordrl.rollout.policy_source import PolicySource, load_policy, resolve_policy

__all__ = ["DEFAULT_MAX_DOCUMENT_TOKENS", "Answer", "Coordinator", "InputError"]

DEFAULT_MAX_DOCUMENT_TOKENS = 1_000_000
_UNSET = object()
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# ``Document 3:`` headers as coordrl lays contexts out; when present, evidence names its Documents.
_DOC_HEADER = re.compile(r"^Document (\d+):\n", re.MULTILINE)


class InputError(DataError):
    """A document or question `Coordinator.answer` cannot take; the message names the problem."""


@dataclass
class Answer:
    """What `Coordinator.answer` returns.

    Attributes:
        answer: the text inside the final ``<answer>...</answer>``; None when the policy gave none
            (ran out of tool rounds, or its last turn holds no answer tag).
        trace: the whole conversation (system, user, assistant turns with tool calls, tool results).
        evidence: every reader finding the policy saw: ``{chunk, documents, text, query, turn}``
            (``documents`` lists ``Document N`` numbers when the text uses coordrl's layout).
        info: episode metrics (turns, reader calls, latencies, ...), ``seconds``, ``document_tokens``.
    """

    answer: str | None
    trace: list[dict[str, Any]]
    evidence: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _decode_document(document: str | bytes) -> str:
    if isinstance(document, (bytes, bytearray, memoryview)):
        raw = bytes(document)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"document is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} ({e.reason}); "
                "re-encode it as UTF-8"
            ) from None
        return text.removeprefix("\ufeff")  # a BOM is an encoding mark, not document text
    if isinstance(document, str):
        return document
    raise InputError(f"document must be str or bytes, got {type(document).__name__}")


def _check_unicode(text: str, what: str) -> None:
    """`InputError` when ``text`` holds a lone surrogate: a str (never bytes decoded as UTF-8) can,
    and a tokenizer raises TypeError on it. A regex scan, not an encode: no copy of a long document."""
    bad = None if text.isascii() else _LONE_SURROGATE.search(text)
    if bad is not None:
        raise InputError(
            f"{what} is not valid Unicode text: a lone surrogate (U+{ord(bad.group()):04X}) at character "
            f"{bad.start():,}; pass UTF-8 bytes or a str without surrogates"
        )


def _doc_offsets(text: str) -> list[int] | None:
    """Character offsets of ``Document 1:``, ``Document 2:``, ... headers when numbered 1..n in order."""
    matches = list(_DOC_HEADER.finditer(text))
    if matches and [int(m.group(1)) for m in matches] == list(range(1, len(matches) + 1)):
        return [m.start() for m in matches]
    return None


class Coordinator:
    """A trained coordinator with its readers, ready to answer questions about documents.

    Build with `from_pretrained`. Thread-safe: `answer` may run from several threads at once
    (`answer_batch` does); an in-process model generates for one episode at a time.

    Args:
        policy: an object with ``act(env)`` (`HFPolicy`, `OpenAIPolicy`, `ScriptedLead`).
        tokenizer: the policy's tokenizer.
        source: the resolved policy (prompt, settings, protocol).
        env_config: `ParserEnvConfig` of the readers, chunking and turn cap (``parser``), or the
            `HmarsEnvConfig` of regions, pages and frozen roles (``hmars``).
        max_turns: tool rounds per episode (per region for ``hmars``); default: ``env_config.max_turns``
            for ``parser``, the policy's evaluation cap (`PolicySource.eval_max_turns`) for ``hmars``.
        max_document_tokens: longest document accepted, in policy tokens (default 1,000,000).
        max_completion_tokens: cap on all turns and tool results of one episode (default None: none).
    """

    def __init__(
        self,
        policy: Any,
        tokenizer: Any,
        source: PolicySource,
        env_config: Any,
        *,
        max_document_tokens: int = DEFAULT_MAX_DOCUMENT_TOKENS,
        max_completion_tokens: int | None = None,
        max_turns: int | None = None,
    ) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.source = source
        self.config = env_config
        self.max_document_tokens = max_document_tokens
        # Most characters one policy token can cover (`coordrl.data.tokens.max_chars_per_token`),
        # computed on first use; None: no safe bound, every document is counted exactly.
        self._chars_per_token: float | object | None = _UNSET
        self.max_completion_tokens = max_completion_tokens
        self.codec = ChatCodec(tokenizer)
        self.protocol = source.protocol
        self._spec = get_protocol(source.protocol)
        # PARSER's env config already holds the evaluation cap (or ``max_turns``); HMARS keeps training's.
        self.max_turns = max_turns or getattr(env_config, "max_turns", None) or source.eval_max_turns(None)
        self._factory = self._spec.factory(env_config, tokenizer=tokenizer)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        readers: str = "lexical",
        reader_model: str | None = None,
        policy_url: str | None = None,
        device: str | None = None,
        max_turns: int | None = None,
        chunk_tokens: int | None = None,
        *,
        served_model: str | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        max_document_tokens: int = DEFAULT_MAX_DOCUMENT_TOKENS,
        hmars: dict[str, Any] | None = None,
        reader_timeout_s: float | None = None,
        reader_retries: int | None = None,
        chunk_overlap_tokens: int | None = None,
        activation: str | None = None,
    ) -> Coordinator:
        """Load a policy (export, checkpoint, model folder, hub id or ``scripted``) and its readers.

        Args:
            folder: the policy (see `resolve_policy`); settings are read from its
                ``coordrl_policy.json`` / ``coordrl_train.json`` when present.
            readers: ``lexical`` (default, model-free) or comma-separated reader server URLs.
            reader_model: the model name served at the reader URLs.
            policy_url: serve the policy from this OpenAI-compatible server (e.g. ``vllm serve
                <export>``) instead of in-process transformers (default None).
            device: in-process device (default: cuda when available).
            max_turns: tool rounds per question (default 12, PARSER's evaluation cap; ``hmars``:
                per region, default training's cap).
            chunk_tokens: tokens per reader chunk (default 4096, PARSER's evaluation size; not
                used by ``hmars``).
            chunk_overlap_tokens: tokens each reader chunk shares with the next (default None: the
                recorded training setting, else 0; not used by ``hmars``).
            activation: which chunk readers a query wakes, ``all`` or ``routed`` (default None: the
                recorded training setting, else ``all``; not used by ``hmars``).
            served_model: model name on ``policy_url`` (default: discovered from ``/v1/models``).
            max_new_tokens: tokens per policy turn (default: training's cap, else 512).
            temperature: 0 (default): greedy.
            seed: sampling seed (default 0).
            max_document_tokens: longest document accepted (default 1,000,000 tokens).
            hmars: `HmarsEnvConfig` fields replacing the ones an ``hmars`` policy recorded at
                training (e.g. ``{"c_sub": 4096, "selector": "http://host:8001/v1"}``).
            reader_timeout_s / reader_retries: per-attempt limit and retries of a reader request
                (default None: the recorded settings, else 60 s and 3); a hung reader costs at most
                timeout x (retries + 1) plus backoff per tool round. ``hmars``: the frozen backends'
                ``backend_timeout_s`` / ``backend_retries``, unless ``hmars`` sets them.
        """
        source = resolve_policy(folder)
        try:
            env_config = source.env_config(
                readers=readers, reader_model=reader_model, max_turns=max_turns, chunk_tokens=chunk_tokens, hmars=hmars,
                chunk_overlap_tokens=chunk_overlap_tokens, activation=activation,
            )  # fmt: skip
            spec = get_protocol(source.protocol)
            limits = {
                k: v
                for k, v in zip(spec.limit_fields, (reader_timeout_s, reader_retries), strict=True)
                if v is not None and k not in (hmars or {})
            }
            env_config = replace(env_config, **limits)
            if spec.uses_readers:
                make_fleet(env_config.readers, env_config.reader_model)
        except ValueError as e:
            if isinstance(e, DataError):
                raise
            raise InputError(str(e)) from None
        policy, tokenizer = load_policy(
            source, policy_url=policy_url, served_model=served_model, device=device,
            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
        )  # fmt: skip
        return cls(policy, tokenizer, source, env_config, max_document_tokens=max_document_tokens, max_turns=max_turns)

    # -- answering -------------------------------------------------------------------------------

    def _validate(self, document: str | bytes, question: str | bytes) -> tuple[str, str, int]:
        text = _decode_document(document)
        if not text or text.isspace():  # not strip(): it would copy a long document
            raise InputError("document is empty")
        if isinstance(question, (bytes, bytearray)):
            try:
                question = bytes(question).decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"question is not valid UTF-8 ({e.reason} at offset {e.start})") from None
        if not isinstance(question, str) or not question.strip():
            raise InputError("question is empty")
        _check_unicode(question, "question")
        return text, " ".join(question.split()), self._document_tokens(text)

    def _document_tokens(self, text: str) -> int:
        """Exact token count of ``text``, or `InputError` when it is over ``max_document_tokens``.

        A document too long to be within the limit is refused from its length alone, before any
        tokenization: tokenizing millions of words takes seconds and gigabytes, and its count is
        not needed to say no. Any other document is counted in windows that stop past the limit
        (`coordrl.data.tokens.count_tokens_up_to`), so memory stays that of one window.
        """
        limit = self.max_document_tokens
        if self._chars_per_token is _UNSET:
            self._chars_per_token = max_chars_per_token(self.tokenizer)
        per_token = self._chars_per_token
        if per_token is not None and len(text) > per_token * limit:
            raise InputError(
                f"document has more than the limit of {limit:,} tokens (max_document_tokens): its {len(text):,} "
                f"characters are at least {math.ceil(len(text) / per_token):,} tokens; split it or raise the limit"
            )
        _check_unicode(text, "document")
        n_tokens = count_tokens_up_to(self.tokenizer, text, limit)
        if n_tokens > limit:
            raise InputError(
                f"document has at least {n_tokens:,} tokens, more than the limit of {limit:,} (max_document_tokens); split it or raise the limit"
            )
        return n_tokens

    def answer(self, document: str | bytes, question: str) -> Answer:
        """Answer ``question`` about ``document`` (raw text, or UTF-8 bytes decoded strictly).

        Raises `InputError` for an empty document, bytes that are not UTF-8, a document over
        ``max_document_tokens`` or an empty question; a failed policy request raises
        `coordrl.rollout.openai_policy.PolicyRequestError`.
        """
        text, question, n_tokens = self._validate(document, question)
        return self._run(text, question, n_tokens)

    def _run(self, text: str, question: str, n_tokens: int) -> Answer:
        if self._spec.answers_by_region:
            return self._run_by_region(text, question, n_tokens)
        env = StepEnv(
            self._factory(), self.codec, max_turns=self.max_turns,
            max_completion_tokens=self.max_completion_tokens, prompt_fn=lambda row: self.source.prompt(row["question"]),
        )  # fmt: skip
        row = {"id": "input", "question": question, "context": text, "doc_offsets": _doc_offsets(text), "answers": [""]}
        t0 = time.perf_counter()
        episode = run_episode(env, self.policy, row)
        info = dict(episode.info)
        info.pop("gold_coverage", None)  # no gold evidence at inference
        info.update(
            seconds=round(time.perf_counter() - t0, 3),
            document_tokens=n_tokens,
            answered=episode.prediction is not None,
        )
        evidence = [
            {
                "chunk": f["chunk"],
                "documents": list(f["documents"]),
                "text": f["text"],
                "query": f["query"],
                "turn": f["turn"],
            }
            for f in episode.findings
        ]
        return Answer(answer=episode.prediction, trace=episode.messages, evidence=evidence, info=info)

    def _run_by_region(self, text: str, question: str, n_tokens: int) -> Answer:
        """All K mid-agent regions with this policy, concurrently; one answer from the merged pages.

        ``trace`` holds one entry per region (``region``, ``subagents``, ``pages``, ``error``,
        ``messages``); ``evidence`` the selected pages (``page``, ``region``, ``subagent``,
        ``documents``, ``tokens``, ``text``) in document order.
        """
        row = {"id": "input", "question": question, "context": text, "doc_offsets": _doc_offsets(text), "answers": []}
        t0 = time.perf_counter()
        result = answer_all_regions(
            self._factory, self.codec, self.policy, row, max_turns=self.max_turns,
            max_completion_tokens=self.max_completion_tokens, prompt_fn=lambda r: self.source.prompt(r["question"]),
        )  # fmt: skip
        info = dict(result.info)
        for key in ("reward", "em", "f1", "recall", "recall_term", "budget_term"):
            info.pop(key, None)  # no gold answer or evidence at inference
        info.update(
            seconds=round(time.perf_counter() - t0, 3), document_tokens=n_tokens, answered=result.answer is not None
        )
        trace = [
            {
                "region": r["region"],
                "subagents": r["subagents"],
                "pages": r["pages"],
                "error": r["error"],
                "messages": r["messages"],
            }
            for r in result.regions
        ]
        return Answer(answer=result.answer, trace=trace, evidence=result.evidence, info=info)

    async def aanswer(self, document: str | bytes, question: str) -> Answer:
        """`answer` for async code: runs in a worker thread, so the caller's event loop stays free."""
        return await asyncio.to_thread(self.answer, document, question)

    def answer_batch(self, items: Sequence[tuple[str | bytes, str]], concurrency: int = 4) -> list[Answer]:
        """Answer many ``(document, question)`` pairs, ``concurrency`` at a time (default 4), in order.

        Every input is validated before any episode starts; a bad one raises `InputError` naming
        its index.
        """
        checked = []
        for i, pair in enumerate(items):
            try:
                document, question = pair
                checked.append(self._validate(document, question))
            except InputError as e:
                raise InputError(f"item {i}: {e}") from None
            except (TypeError, ValueError):
                raise InputError(f"item {i}: expected a (document, question) pair") from None
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(lambda c: self._run(*c), checked))

    def close(self) -> None:
        """Close the reader connections (and the policy's HTTP client)."""
        self._factory.close()
        close = getattr(getattr(self.policy, "policy", self.policy), "close", None)
        if callable(close):
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
