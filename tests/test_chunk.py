import bisect
import itertools

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from coordrl.data.chunk import Chunk, _piece_spans, chunk_context
from coordrl.data.errors import DataError
from coordrl.data.layout import Paragraph, render_context
from coordrl.data.records import load_records
from coordrl.data.tokens import cached_counter, load_tokenizer
from coordrl.rollout.models import WORLD_MODEL, resolve_model


@pytest.fixture(scope="module")
def tok():
    return cached_counter(None).tokenizer


def reference_chunks(context, tokenizer, chunk_tokens, doc_offsets=None):
    """Chunking as coordrl did it before pieces: one whole-context call, every offset read back."""
    offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    n_tokens = len(offsets)
    starts = [(0, 0)]
    for t in range(chunk_tokens, n_tokens, chunk_tokens):
        c = offsets[t][0]
        if c > starts[-1][0]:
            starts.append((c, t))
    starts.append((len(context), n_tokens))
    chunks = []
    for i in range(len(starts) - 1):
        (c0, t0), (c1, t1) = starts[i], starts[i + 1]
        docs = ()
        if doc_offsets:
            first = max(bisect.bisect_right(doc_offsets, c0) - 1, 0)
            last = bisect.bisect_right(doc_offsets, c1 - 1) - 1
            docs = tuple(range(first + 1, last + 2))
        chunks.append(Chunk(i, context[c0:c1], t0, t1, c0, c1, docs))
    return chunks


@pytest.fixture(scope="module")
def document():
    """About 45K tokens of real HotpotQA paragraphs, with multi-byte text in some of them."""
    records, _ = load_records("sample", "hotpotqa")
    paras = [p for r in records[:30] for p in r.paragraphs]
    paras[5::40] = [Paragraph(p.title + " – Fernán-Gómez", p.body + " ü 😀 東京 ") for p in paras[5::40]]
    return render_context(paras)


@pytest.mark.parametrize("tokenizer_spec", [None, WORLD_MODEL])
def test_piecewise_chunks_equal_whole_context_chunks(document, tokenizer_spec):
    # The shipped tokenizer and the world model's (a different vocabulary and split pattern).
    tokenizer = load_tokenizer(tokenizer_spec and resolve_model(tokenizer_spec))
    context, offsets = document
    assert _piece_spans(context, tokenizer) is not None, "the piecewise path was not taken"
    for size in (1, 7, 64, 512, 4096):
        assert chunk_context(context, tokenizer, size, offsets) == reference_chunks(context, tokenizer, size, offsets)


def _glued_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """A BPE without a splitting pre-tokenizer, trained so that merges run across newlines."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_unclean_cuts_fall_back_to_whole_context_and_backend_settings_do_not_leak(tok):
    paras = [Paragraph(f"Doc {i}", "The mill\nDoc stands by the river.\nDoc again. " * 4) for i in range(60)]
    context, offsets = render_context(paras)
    glued = _glued_tokenizer(context)
    assert _piece_spans(context, glued) is None  # a merge crosses "\nD": pieces would change the tokens
    assert chunk_context(context, glued, 50, offsets) == reference_chunks(context, glued, 50, offsets)
    # The pieces go through the tokenizer's own call, as the whole context did: a backend left set
    # to truncate (tokenizer.json can say so) cuts neither.
    truncating = load_tokenizer(None)
    truncating.backend_tokenizer.enable_truncation(16)
    assert _piece_spans(context, truncating) is not None
    assert chunk_context(context, truncating, 50, offsets) == reference_chunks(context, tok, 50, offsets)


def test_chunks_tile_the_context_and_know_their_documents(tok):
    paras = [Paragraph(f"Title {i} – Fernán-Gómez", "Some text ü 😀 here. " * (i % 7 + 1)) for i in range(60)]
    context, offsets = render_context(paras)
    chunks = chunk_context(context, tok, 64, offsets)
    assert "".join(c.text for c in chunks) == context
    n_tokens = len(tok(context, add_special_tokens=False)["input_ids"])
    assert chunks[0].token_start == 0 and chunks[-1].token_end == n_tokens
    for a, b in itertools.pairwise(chunks):
        assert a.token_end == b.token_start and a.char_end == b.char_start
        assert a.documents[-1] in (b.documents[0], b.documents[0] - 1)
    _check_documents(chunks, offsets, len(context))


def _check_documents(chunks, offsets, length):
    for c in chunks:
        for doc in range(1, len(offsets) + 1):
            start = offsets[doc - 1]
            end = offsets[doc] if doc < len(offsets) else length
            overlaps = start < c.char_end and c.char_start < end
            assert (doc in c.documents) == overlaps


@pytest.mark.parametrize(("size", "overlap"), [(64, 16), (64, 63), (512, 128), (7, 3)])
def test_overlapping_chunks_cover_the_context_and_share_exactly_the_overlap(document, tok, size, overlap):
    context, offsets = document
    chunks = chunk_context(context, tok, size, offsets, overlap_tokens=overlap)
    n_tokens = len(tok(context, add_special_tokens=False)["input_ids"])
    assert chunks[0].char_start == 0 and chunks[0].token_start == 0
    assert chunks[-1].char_end == len(context) and chunks[-1].token_end == n_tokens
    stride = size - overlap
    for a, b in itertools.pairwise(chunks):
        assert a.token_end - b.token_start == overlap  # shared tokens
        assert a.char_start < b.char_start < a.char_end <= b.char_end  # overlapping, in order, no gap
        assert context[b.char_start : a.char_end] == a.text[b.char_start - a.char_start :]
        assert context[b.char_start : a.char_end] == b.text[: a.char_end - b.char_start]
        step = b.token_start - a.token_start
        assert step % stride == 0 and a.token_end - a.token_start == step + overlap
        # A longer step only where the starts in between fell inside one multi-byte character.
        assert step == stride or not context[a.char_start : b.char_start + 1].isascii()
    assert sum(c.token_end - c.token_start > size for c in chunks) <= len(chunks) // 20
    assert chunks[-2].token_end < n_tokens  # no chunk lies wholly inside the one before it
    _check_documents(chunks, offsets, len(context))


def test_a_fact_on_a_boundary_appears_whole_in_an_overlapping_chunk(document, tok):
    context, _ = document
    size, fact = 512, " The vault code is 4471 and the vault is in Zebra Orchard."
    boundary = reference_chunks(context, tok, size)[3].char_start
    context = context[: boundary - 20] + fact + context[boundary - 20 :]  # straddles the fourth boundary
    fact_tokens = len(tok(fact, add_special_tokens=False)["input_ids"])
    assert not any(fact in c.text for c in chunk_context(context, tok, size))  # tiling cuts it
    assert any(fact in c.text for c in chunk_context(context, tok, size, overlap_tokens=fact_tokens + 2))


def test_chunk_edge_cases(tok):
    assert chunk_context("", tok, 512) == []
    one = chunk_context("short text", tok, 512)
    assert len(one) == 1 and one[0].text == "short text" and one[0].documents == ()
    assert chunk_context("short text", tok, 512, overlap_tokens=100) == one
    with pytest.raises(DataError):
        chunk_context("x", tok, 0)
    for bad in (-1, 512, 600):
        with pytest.raises(DataError, match="overlap"):
            chunk_context("x", tok, 512, overlap_tokens=bad)
