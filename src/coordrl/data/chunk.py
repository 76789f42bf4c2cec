"""Splitting a sample's context into fixed-size token chunks, one per reader.

Chunks are contiguous and, without overlap, concatenate back to the context exactly. With
``overlap_tokens`` > 0 each chunk starts ``chunk_tokens - overlap_tokens`` tokens after the previous
one, so consecutive chunks share ``overlap_tokens`` tokens and a fact that straddles a boundary
appears whole in one of them. Boundaries are taken from the tokenizer's character offsets rather
than by decoding token slices, so a multi-byte character split across byte-level tokens is never
corrupted. Each chunk knows its token and character span and the Document numbers it covers (for
gold-evidence coverage).

Speed: a 1M-token context is tokenized in pieces of about `_PIECE_CHARS` characters cut at clean
newlines, in one batch call that the tokenizers library spreads over the cores. Tokenizing one
multi-megabyte string costs about twice the CPU of the same text in pieces, and only the offsets of
chunk-boundary tokens are read, never the whole offset list (a million Python tuples). Every cut
is checked (the characters around it tokenize to the same ids together as apart); where the cuts
are not clean the whole context is tokenized at once, as before.
Either way the chunks are the same.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from coordrl.data.errors import DataError
from coordrl.data.tokens import _CUT_CHECK_CHARS, _WINDOW_CUT

# Characters per tokenized piece: small enough for many pieces per core and a cheap batch, large
# enough that the cut checks (2 x 64 characters each) add only a few percent.
_PIECE_CHARS = 1 << 12


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


# (tokens in the text, token index -> its character span [start, end))
TokenSpans = tuple[int, Callable[[int], tuple[int, int]]]


def _whole_text_spans(context: str, tokenizer) -> TokenSpans:
    """Tokenize the context in one call (the reference method; the fallback of `_piece_spans`)."""
    offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return len(offsets), lambda t: tuple(offsets[t])


def _clean(context: str, cuts: list[int], tokenizer) -> bool:
    """Whether the characters around every cut tokenize to the same ids together as apart."""
    lefts = [context[max(0, c - _CUT_CHECK_CHARS) : c] for c in cuts]
    rights = [context[c : c + _CUT_CHECK_CHARS] for c in cuts]
    texts = [a + b for a, b in zip(lefts, rights, strict=True)] + lefts + rights
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    k = len(cuts)
    return all(ids[i] == ids[k + i] + ids[2 * k + i] for i in range(k))


def _piece_spans(context: str, tokenizer) -> TokenSpans | None:
    """The tokens of ``context`` from pieces tokenized in one parallel batch, or None where that
    cannot be shown to give exactly the tokens of the whole text. The tokenizer is called as for the
    whole text (same settings: no truncation or padding, special tokens as configured)."""
    cuts: list[int] = []  # right after a newline, before a non-space character
    pos = _PIECE_CHARS
    while pos < len(context) - _PIECE_CHARS:
        match = _WINDOW_CUT.search(context, pos)
        if match is None:
            break
        cuts.append(match.end())
        pos = match.end() + _PIECE_CHARS
    if not cuts:
        return None
    # Split patterns differ on a run of newlines before text: the Qwen and Llama 3 families keep
    # "\n\n" as one pre-token, so the cut goes after the run; the GPT-2 family splits the run before
    # its last newline (``\s+(?!\S)``), so the cut goes there. Whichever is clean here is used.
    if not _clean(context, cuts, tokenizer):
        cuts = [c - 1 for c in cuts]
        if not _clean(context, cuts, tokenizer):
            return None
    bounds = [0, *cuts, len(context)]
    texts = [context[a:b] for a, b in itertools.pairwise(bounds)]
    pieces = tokenizer(texts, add_special_tokens=False, return_attention_mask=False).encodings
    if pieces is None:  # not a tokenizers-backed result: no offsets to read back
        return None
    first = list(itertools.accumulate((len(p) for p in pieces), initial=0))  # first token of each piece

    def span(t: int) -> tuple[int, int]:
        p = bisect.bisect_right(first, t) - 1
        start, end = pieces[p].token_to_chars(t - first[p])
        return bounds[p] + start, bounds[p] + end

    return first[-1], span


def chunk_context(
    context: str,
    tokenizer,
    chunk_tokens: int,
    doc_offsets: Sequence[int] | None = None,
    overlap_tokens: int = 0,
) -> list[Chunk]:
    """Split ``context`` into chunks of at most ``chunk_tokens`` tokens.

    Args:
        context: the sample's context.
        tokenizer: a fast (offset-reporting) Hugging Face tokenizer, the policy's or the reader's.
        chunk_tokens: tokens per chunk (512 for training, 4,096 for evaluation by default).
        doc_offsets: the sample's ``doc_offsets`` (character offset of each Document header); when
            given, each chunk lists the Documents it covers.
        overlap_tokens: tokens each chunk shares with the next (default 0: chunks tile the context);
            ``0 <= overlap_tokens < chunk_tokens``. The last chunk ends at the end of the context and
            no chunk lies wholly inside the one before it.
    """
    if chunk_tokens < 1:
        raise DataError(f"chunk size must be a positive number of tokens, got {chunk_tokens}")
    if not 0 <= overlap_tokens < chunk_tokens:
        raise DataError(
            f"chunk overlap must be at least 0 and below the chunk size {chunk_tokens}, got {overlap_tokens}"
        )
    if not context:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("chunking needs a fast tokenizer (one that reports character offsets)")
    n_tokens, span = _piece_spans(context, tokenizer) or _whole_text_spans(context, tokenizer)
    stride = chunk_tokens - overlap_tokens
    # (char, token) where each chunk starts; chars strictly increase so no two chunks start together.
    # A chunk follows only while the one before it stops short of the end (t - stride + chunk_tokens < n).
    starts = [(0, 0)]
    for t in range(stride, n_tokens - overlap_tokens, stride):
        c = span(t)[0]
        if c > starts[-1][0]:
            starts.append((c, t))
    chunks = []
    for i, (c0, t0) in enumerate(starts):
        # A chunk reaches the next one's start plus the overlap; without overlap it ends exactly
        # where the next begins. An overlapping chunk whose last token is part of a multi-byte
        # character keeps that character whole.
        t1 = min(starts[i + 1][1] + overlap_tokens, n_tokens) if i + 1 < len(starts) else n_tokens
        if t1 == n_tokens:
            c1 = len(context)
        elif overlap_tokens:
            c1 = max(span(t1)[0], span(t1 - 1)[1])
        else:
            c1 = starts[i + 1][0]
        docs: tuple[int, ...] = ()
        if doc_offsets:
            first = max(bisect.bisect_right(doc_offsets, c0) - 1, 0)
            last = bisect.bisect_right(doc_offsets, c1 - 1) - 1
            docs = tuple(range(first + 1, last + 2))
        chunks.append(Chunk(i, context[c0:c1], t0, t1, c0, c1, docs))
    return chunks
