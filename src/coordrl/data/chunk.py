"""Splitting a sample's context into fixed-size token chunks, one per reader.

Chunks are contiguous, never overlap, and concatenate back to the context exactly. Boundaries are
taken from the tokenizer's character offsets rather than by decoding token slices, so a multi-byte
character split across byte-level tokens is never corrupted. Each chunk knows its token and
character span and the Document numbers it covers (for gold-evidence coverage).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from coordrl.data.errors import DataError


@dataclass(frozen=True)
class Chunk:
    """One reader's slice of the context. Token spans are ``[token_start, token_end)``."""

    index: int
    text: str
    token_start: int
    token_end: int
    char_start: int
    char_end: int
    documents: tuple[int, ...]  # 1-based Document numbers with at least one character in the chunk

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["documents"] = list(self.documents)
        return d


def chunk_context(context: str, tokenizer, chunk_tokens: int, doc_offsets: Sequence[int] | None = None) -> list[Chunk]:
    """Split ``context`` into chunks of at most ``chunk_tokens`` tokens.

    Args:
        context: the sample's context.
        tokenizer: a fast (offset-reporting) Hugging Face tokenizer, the policy's or the reader's.
        chunk_tokens: tokens per chunk (512 for training, 4,096 for evaluation by default).
        doc_offsets: the sample's ``doc_offsets`` (character offset of each Document header); when
            given, each chunk lists the Documents it covers.
    """
    if chunk_tokens < 1:
        raise DataError(f"chunk size must be a positive number of tokens, got {chunk_tokens}")
    if not context:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("chunking needs a fast tokenizer (one that reports character offsets)")
    enc = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    n_tokens = len(offsets)
    # (char, token) where each chunk starts; chars strictly increase so chunks never share a character.
    starts = [(0, 0)]
    for t in range(chunk_tokens, n_tokens, chunk_tokens):
        c = offsets[t][0]
        if c > starts[-1][0]:
            starts.append((c, t))
    starts.append((len(context), n_tokens))
    chunks = []
    for i in range(len(starts) - 1):
        (c0, t0), (c1, t1) = starts[i], starts[i + 1]
        docs: tuple[int, ...] = ()
        if doc_offsets:
            first = max(bisect.bisect_right(doc_offsets, c0) - 1, 0)
            last = bisect.bisect_right(doc_offsets, c1 - 1) - 1
            docs = tuple(range(first + 1, last + 2))
        chunks.append(Chunk(i, context[c0:c1], t0, t1, c0, c1, docs))
    return chunks
