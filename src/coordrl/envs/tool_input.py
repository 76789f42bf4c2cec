"""Checks on what a policy sends to a tool, applied before the input reaches a tokenizer or parser.

Tool arguments come from JSON the policy wrote, so they can hold anything JSON can spell: lone
surrogates (``"\\ud800"`` decodes to a string that cannot be encoded as UTF-8, and a Hugging Face
tokenizer raises ``TypeError`` on it), numbers too large to print (``str`` of an int over 4,300
digits raises ``ValueError``), and nesting deep enough that Python's JSON decoder raises
``RecursionError``, which TRL's parser does not catch. Code calling the tools directly can pass
any object, including one whose ``str`` raises. Every such input is refused here with a
`ToolInputError` (counted by the environment and shown to the policy), never by an exception from
deep inside a library.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "MAX_TOOL_CALL_DEPTH",
    "ToolInputError",
    "check_text",
    "repair_text",
    "safe_str",
    "tool_call_too_deep",
    "unencodable_at",
]

# Deepest bracket nesting accepted in one tool call. Real calls nest 3 levels ({"name", "arguments":
# {"queries": [...]}}); Python's JSON decoder fails with RecursionError near 1,000.
MAX_TOOL_CALL_DEPTH = 32

_TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL_CLOSE = "</tool_call>"
# The characters that change JSON nesting or string state; everything else is skipped in C.
_JSON_SIGNIFICANT = re.compile(r'[\[\]{}"\\]')
_SURROGATE = re.compile("[\ud800-\udfff]")


class ToolInputError(ValueError):
    """A tool call the environment refuses; the message goes back to the policy as the tool result.

    ``kind`` names the problem (``wrong_type``, ``empty``, ``too_long``, ``unencodable``, ...) and
    is the key under which the environment counts it.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def unencodable_at(text: str) -> int | None:
    """Index of the first character of ``text`` that UTF-8 cannot encode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def repair_text(text: str) -> tuple[str, int]:
    """``text`` with every lone surrogate replaced by U+FFFD, and how many were replaced."""
    if unencodable_at(text) is None:
        return text, 0
    return _SURROGATE.subn("\ufffd", text)


def safe_str(value: Any, limit: int | None = 200) -> str:
    """``str(value)`` cut to ``limit`` characters (None: whole), or a placeholder naming the type when
    ``str`` raises (an object with a broken ``__str__``, an int too large to print). Lone surrogates
    become U+FFFD, so the result can always be tokenized."""
    try:
        text = str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"
    if not isinstance(text, str):  # a __str__ returning a str subclass that misbehaves
        return f"<unprintable {type(value).__name__}>"
    text = str.__str__(text)
    return repair_text(text if limit is None else text[:limit])[0]


def check_text(value: Any, what: str) -> str:
    """``value`` as a plain ``str`` when it is a string UTF-8 can encode; else `ToolInputError`.

    ``what`` names the argument in the message (e.g. ``"query 2"``). A ``str`` subclass is copied to a
    plain ``str`` so that its overridden methods never run.
    """
    if not isinstance(value, str):
        raise ToolInputError("wrong_type", f"{what} is a {type(value).__name__}, not a string")
    text = str.__str__(value)
    bad = unencodable_at(text)
    if bad is not None:
        raise ToolInputError(
            "unencodable",
            f"{what} holds a character that is not valid Unicode text (U+{ord(text[bad]):04X}, a lone "
            f"surrogate, at position {bad}); send plain UTF-8 text",
        )
    return text


def _depth_from(text: str, start: int, end: int, limit: int) -> bool:
    """Whether brackets between ``start`` and ``end`` nest deeper than ``limit``, reading JSON strings
    as a JSON decoder does (brackets inside ``"..."`` do not count, ``\\"`` does not end a string)."""
    depth = 0
    in_string = False
    skip = -1  # position of a character escaped by a backslash inside a string
    for match in _JSON_SIGNIFICANT.finditer(text, start, end):
        pos = match.start()
        if pos == skip:
            continue
        ch = match.group()
        if in_string:
            if ch == "\\":
                skip = pos + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def tool_call_too_deep(text: str, limit: int = MAX_TOOL_CALL_DEPTH) -> bool:
    """Whether some ``<tool_call>`` in ``text`` nests brackets deeper than ``limit``.

    Calls are cut as the tool-call parser cuts them (an opening tag up to the next closing tag, the
    next call after that; an unclosed one runs to the end of the text) and each is scanned the way
    a JSON decoder reads it, so a decoder never nests deeper than the scan found: a call that stops
    being valid JSON earlier fails in the decoder with ``ValueError`` first. Linear in the text.
    """
    if text.count("[") + text.count("{") <= limit:  # the common case: too few brackets to matter
        return False
    start = text.find(_TOOL_CALL_OPEN)
    while start != -1:
        body = start + len(_TOOL_CALL_OPEN)
        end = text.find(_TOOL_CALL_CLOSE, body)
        if _depth_from(text, body, len(text) if end == -1 else end, limit):
            return True
        if end == -1:
            return False
        start = text.find(_TOOL_CALL_OPEN, end + len(_TOOL_CALL_CLOSE))
    return False
