"""Token counting for samples, with per-paragraph costs computed once per job.

A 32K-sample build holds about a billion tokens; tokenizing every context would dominate the build.
Each paragraph is tokenized once (with and without the blank-line separator that follows it) and a
context's count is the sum of its headers and paragraphs. That sum is exact when the tokenizer's
pre-tokenizer splits at newlines (Qwen, Llama 3, GPT-2 families). Every job checks this on real
contexts first and falls back to tokenizing each whole context when the check fails, so the
recorded ``num_tokens`` is always exact; the card says which method ran.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path

from coordrl.data.errors import DataError
from coordrl.data.layout import (
    DOC_SEPARATOR,
    Paragraph,
    document_header,
    render_context,
)

SHIPPED_TOKENIZER = "coordrl-tiny"


def shipped_tokenizer_dir() -> Path:
    return Path(str(resources.files("coordrl").joinpath("resources", "tokenizer")))


def load_tokenizer(spec: str | None):
    """Load a tokenizer: None or ``coordrl-tiny`` (shipped, offline), a local folder, or a hub id.

    Tokenizers load from JSON/text files only; nothing is unpickled.
    """
    from transformers import AutoTokenizer

    if spec in (None, "", SHIPPED_TOKENIZER):
        path = shipped_tokenizer_dir()
        if not (path / "tokenizer.json").exists():
            raise DataError(f"the shipped tokenizer is missing from {path}; reinstall coordrl")
        return AutoTokenizer.from_pretrained(str(path))
    try:
        return AutoTokenizer.from_pretrained(spec)
    except Exception as e:
        hint = " (HF_HUB_OFFLINE is set: pass a local folder)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise DataError(f"could not load tokenizer {spec!r}{hint}: {e}") from None


# Most characters one UTF-8 byte of normalised text can stand for in the original text: canonical
# composition (NFC, NFKC) merges a decomposed sequence into one character, at worst 3 characters
# into a 2-byte one ("U" + U+0308 + U+0304 -> U+01D5); decomposition only lengthens text.
_COMPOSING = {"NFC": 1.5, "NFKC": 1.5, "NFD": 1.0, "NFKD": 1.0}
# Pre-tokenizers that keep every character (a Split that is not "Removed"); others may drop text.
_LOSSLESS_PRE = {"ByteLevel", "Split", "Digits", "Punctuation"}


def _state(component) -> dict:
    return json.loads(component.__getstate__())


def max_chars_per_token(tokenizer) -> float | None:
    """The most characters of input text a single token can stand for, or None when the tokenizer
    gives no such guarantee. ``len(text) / max_chars_per_token(tok)`` is then a lower bound on the
    tokens of ``text``, so a text longer than ``limit * max_chars_per_token(tok)`` characters is over
    ``limit`` tokens without tokenizing it.

    Why it holds, and when (byte-level BPE: Qwen, Llama 3, GPT-2 and the shipped tokenizer):
    the byte-level pre-tokenizer turns every byte of the normalised text into one symbol of a
    256-symbol alphabet, and a BPE model whose vocabulary holds the whole alphabet never drops a
    symbol, so the tokens partition the bytes: ``tokens >= bytes / B`` where ``B`` is the longest
    vocabulary entry in bytes (added tokens by their UTF-8 length). Every character is at least one
    byte, and a composing normaliser can shrink text at most 1.5 characters per byte (see
    ``_COMPOSING``), so ``tokens >= chars / (1.5 * B)`` with NFC/NFKC and ``chars / B`` without.
    A characters-per-token *average* would be the wrong direction: it says what text usually
    costs, not the least it can cost. Anything else (no ByteLevel step, a normaliser or
    pre-tokenizer that can delete text, byte fallback, a slow tokenizer) returns None: count exactly.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    pre = _state(backend.pre_tokenizer) if backend.pre_tokenizer is not None else {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(p.get("type") == "ByteLevel" for p in steps):
        return None
    if any(p.get("type") not in _LOSSLESS_PRE or p.get("behavior") == "Removed" for p in steps):
        return None
    factor = 1.0
    if backend.normalizer is not None:
        norm = _state(backend.normalizer)
        parts = norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
        if any(n.get("type") not in _COMPOSING for n in parts):
            return None
        factor = max(_COMPOSING[n["type"]] for n in parts)
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = backend.get_vocab(with_added_tokens=False)
    if not all(symbol in vocab for symbol in ByteLevel.alphabet()):
        return None
    longest = max(len(token) for token in vocab)  # byte-level entries spell one symbol per byte
    added = [len(t.content.encode("utf-8")) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    return factor * max([longest, *added])


# A window boundary: right after a newline and before a non-space character. The split patterns
# of the GPT-2, Llama 3 and Qwen families never join a newline to the character after it, so the
# pre-tokens, and so the tokens, on either side are those of the whole text.
_WINDOW_CUT = re.compile(r"\n(?=\S)")
# Characters each side of a cut tokenized together and apart to check that the cut is clean.
_CUT_CHECK_CHARS = 64


def count_tokens_up_to(tokenizer, text: str, limit: int, window_chars: int = 1 << 18) -> int:
    """Tokens of ``text`` (no special tokens added): exact when at most ``limit``; past the limit,
    counting stops and some number above ``limit`` is returned.

    The text is tokenized in windows of about ``window_chars`` characters (default 262,144) cut at
    newlines (`_WINDOW_CUT`), so memory stays that of one window rather than growing with the
    document, and an over-long document is only read up to the limit. Every cut is checked (the
    characters around it tokenize to the same count together as apart); when one is not clean, or
    the text has no cut, the whole text is tokenized at once, as before.
    """

    def count(piece: str) -> int:
        return len(tokenizer(piece, add_special_tokens=False)["input_ids"])

    cuts: list[int] = []
    pos = window_chars
    while pos < len(text) - window_chars:
        match = _WINDOW_CUT.search(text, pos)
        if match is None:
            break
        cut = match.end()
        left, right = text[max(0, cut - _CUT_CHECK_CHARS) : cut], text[cut : cut + _CUT_CHECK_CHARS]
        if count(left + right) != count(left) + count(right):
            return count(text)
        cuts.append(cut)
        pos = cut + window_chars
    if not cuts:
        return count(text)
    total = 0
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        total += count(text[start:end])
        if total > limit:
            break
    return total


class TokenCounter:
    """Counts context tokens with one tokenizer. See the module docstring for the method."""

    def __init__(self, tokenizer, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.additive = True  # set by `verify`
        self._headers: list[int] = [0]

    def _lengths(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        enc = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [len(ids) for ids in enc]

    def count(self, text: str) -> int:
        """Exact token count of one text (no special tokens added)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def header(self, index: int) -> int:
        """Tokens of ``"Document {index}:\\n"``; cached for all indices up to the largest seen."""
        if index >= len(self._headers):
            start = len(self._headers)
            self._headers.extend(self._lengths([document_header(i) for i in range(start, max(index + 1, 2 * start))]))
        return self._headers[index]

    def paragraph_costs(self, paragraphs: Sequence[Paragraph], batch: int = 2048) -> list[int]:
        """Per paragraph: tokens of its text followed by the blank-line separator.

        The last Document of a context has no separator; callers count that one paragraph alone.
        """
        costs: list[int] = []
        for start in range(0, len(paragraphs), batch):
            costs += self._lengths([p.text + DOC_SEPARATOR for p in paragraphs[start : start + batch]])
        return costs

    def context_tokens(self, paragraphs: Sequence[Paragraph], costs: Sequence[int]) -> int:
        """Tokens of the rendered context of ``paragraphs`` from their `paragraph_costs` (the additive method;
        exact only when `verify` passed, so callers count whole contexts when ``additive`` is False)."""
        if not paragraphs:
            return 0
        return self.headers_total(len(paragraphs)) + sum(costs[:-1]) + self.count(paragraphs[-1].text)

    def headers_total(self, n: int) -> int:
        self.header(n)
        return sum(self._headers[1 : n + 1])

    def verify(self, contexts: Sequence[Sequence[Paragraph]]) -> bool:
        """Check additivity on real contexts; on any mismatch switch to exact whole-context counting."""
        for paragraphs in contexts:
            summed = self.context_tokens(paragraphs, self.paragraph_costs(paragraphs))
            if summed != self.count(render_context(paragraphs)[0]):
                self.additive = False
                return False
        return True


@lru_cache(maxsize=4)
def cached_counter(spec: str | None) -> TokenCounter:
    return TokenCounter(load_tokenizer(spec), spec or SHIPPED_TOKENIZER)
