"""Rendering and parsing the policy's conversation exactly as TRL's GRPOTrainer does.

Evaluation and inference must see the tokens training saw. `ChatCodec` therefore calls TRL's own
pieces instead of re-implementing them: ``add_response_schema`` and ``get_training_chat_template``
(the prefix-preserving template TRL swaps in for tool training), ``parse_response`` (tool-call
parsing) and ``GRPOTrainer._get_tool_suffix_ids`` (the tokens appended after a tool round, so that
conversations grow by concatenating ids, never by re-tokenizing). Pinned to TRL 1.16.x;
``tests/test_trl_contract.py`` fails loudly if these internals change shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
)
from trl.trainer.grpo_trainer import GRPOTrainer

from coordrl.envs.tool_input import tool_call_too_deep

_NOT_TOOLS = ("reset", "get_reward")


def env_tools(env: Any) -> list[Callable[..., Any]]:
    """The methods of ``env`` that TRL exposes as tools: public functions other than reset/get_reward."""
    return [
        getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in _NOT_TOOLS and not name.startswith("_")
    ]


class ChatCodec:
    """The policy tokenizer prepared as GRPOTrainer prepares it, with render/parse helpers.

    Args:
        tokenizer: the policy's Hugging Face tokenizer (modified in place, as TRL does: a response
            template for tool-call parsing is attached when missing).
        chat_template_kwargs: extra template arguments, as ``GRPOConfig.chat_template_kwargs``.
    """

    def __init__(self, tokenizer, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            tokenizer = add_response_schema(tokenizer)
        self.tokenizer = tokenizer
        self.chat_template = (
            None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
        )
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # The attributes GRPOTrainer._get_tool_suffix_ids reads from the trainer.
        self._trl_view = SimpleNamespace(
            processing_class=tokenizer,
            _tokenizer=tokenizer,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            _is_vlm=False,
        )

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: Sequence[Callable[..., Any]] | None) -> list[int]:
        """Token ids of a prompt conversation with the generation prompt, as TRL renders it."""
        out = self.tokenizer.apply_chat_template(
            conversation=list(messages),
            tools=list(tools) or None if tools else None,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **self.chat_template_kwargs,
        )
        ids = out["input_ids"]
        return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[Callable[..., Any]] | None = None) -> str:
        """The prompt text (for logs and traces)."""
        return self.tokenizer.decode(self.prompt_ids(messages, tools))

    def tool_suffix_ids(self, tool_messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids appended after an assistant turn's tool results, up to the next generation prompt."""
        return GRPOTrainer._get_tool_suffix_ids(self._trl_view, list(tool_messages))

    def parse(
        self, completion_ids: Sequence[int], prefix_ids: Sequence[int], tools: Sequence[Callable[..., Any]] | None
    ) -> dict[str, Any]:
        """One assistant turn's ids -> ``{"role": "assistant", "content", ["tool_calls"]}`` (TRL's parser).

        A turn whose tool-call JSON nests deeper than `coordrl.envs.tool_input.MAX_TOOL_CALL_DEPTH`
        is not handed to the parser (Python's JSON decoder would raise RecursionError, which TRL
        does not catch): it becomes what TRL makes of any malformed tool call, the decoded text
        with no ``tool_calls``.
        """
        ids = list(completion_ids)
        if tool_call_too_deep(self.tokenizer.decode(ids, skip_special_tokens=False)):
            return self._unparsed(ids)
        try:
            return parse_response(self.tokenizer, ids, prefix=list(prefix_ids), tools=list(tools or []) or None)
        except RecursionError:  # deep nesting in a tool-call format the scan above does not know
            return self._unparsed(ids)

    def _unparsed(self, ids: list[int]) -> dict[str, Any]:
        # TRL's own fallback for a turn its parser rejects (trl.chat_template_utils.parse_response).
        return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}

    def encode_turn(self, text: str) -> list[int]:
        """Ids of an assistant turn given as text, ended with EOS as a generated turn would be."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return ids if ids and ids[-1] == eos else ids + [eos]


def guard_tool_call_parsing(tokenizer) -> None:
    """Make ``tokenizer.parse_response`` refuse too-deep tool-call JSON with ``ValueError``.

    TRL's trainer parses every generated turn with ``trl.chat_template_utils.parse_response``, which
    falls back to plain text on ``ValueError``/``TypeError`` but lets ``RecursionError`` (JSON nested
    ~1,000 deep) end the training run. Wrapping this one tokenizer's method (idempotent) turns such a
    turn into what TRL makes of any malformed call, as `ChatCodec.parse` does for evaluation and
    inference, without copying TRL's parser.
    """
    original = tokenizer.parse_response
    if getattr(original, "_coordrl_depth_guard", False):
        return

    def parse_response(ids, *args: Any, **kwargs: Any):
        if tool_call_too_deep(tokenizer.decode(list(ids), skip_special_tokens=False)):
            raise ValueError("tool-call JSON nested too deep")
        try:
            return original(ids, *args, **kwargs)
        except RecursionError as err:
            raise ValueError("tool-call JSON nested too deep") from err

    parse_response._coordrl_depth_guard = True  # type: ignore[attr-defined]
    tokenizer.parse_response = parse_response
