import itertools

import pytest

from coordrl.data.chunk import chunk_context
from coordrl.data.errors import DataError
from coordrl.data.layout import Paragraph, render_context
from coordrl.data.tokens import cached_counter


@pytest.fixture(scope="module")
def tok():
    return cached_counter(None).tokenizer


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
    for c in chunks:
        assert c.token_end - c.token_start <= 64
        for doc in range(1, 61):
            start = offsets[doc - 1]
            end = offsets[doc] if doc < 60 else len(context)
            overlaps = start < c.char_end and c.char_start < end
            assert (doc in c.documents) == overlaps


def test_chunk_edge_cases(tok):
    assert chunk_context("", tok, 512) == []
    one = chunk_context("short text", tok, 512)
    assert len(one) == 1 and one[0].text == "short text" and one[0].documents == ()
    with pytest.raises(DataError):
        chunk_context("x", tok, 0)
