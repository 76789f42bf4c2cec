"""Over-long documents are refused from their length, before tokenization; near the limit, exactly."""

from __future__ import annotations

import tracemalloc

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from coordrl.data.tokens import load_tokenizer, max_chars_per_token
from coordrl.inference.coordinator import Coordinator, InputError


@pytest.fixture(scope="module")
def coord():
    with Coordinator.from_pretrained("scripted", max_document_tokens=50_000) as c:
        yield c


def test_over_long_document_is_refused_without_tokenizing_it(coord):
    document = "Document 1:\nTitle\n" + "Paris is the capital of France. " * 100_000  # 3.2 M characters
    size = len(document)  # bytes: the text is ASCII
    coord.answer("Document 1:\nParis\nParis is in France.", "Where is Paris?")  # one-time setup outside the measurement
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=r"more than the limit of 50,000 tokens .*characters are at least"):
            coord.answer(document, "What is the capital of France?")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Tokenizing it would build Python lists of ~700K ids (well over 2x the document): nothing like it.
    assert peak < 2 * size, f"peak {peak:,} B traced for a {size:,} B document"
    assert peak < size // 10


def test_near_the_limit_the_count_is_exact(coord):
    tok = coord.tokenizer
    unit = "Paris is the capital of France. "
    per_unit = len(tok(unit * 10, add_special_tokens=False)["input_ids"]) / 10
    over = unit * int(50_000 / per_unit * 1.1)  # ~10% over: within the length bound, so counted
    assert len(over) < max_chars_per_token(tok) * 50_000
    with pytest.raises(InputError, match=r"document has [\d,]+ tokens, more than the limit of 50,000"):
        coord.answer(over, "What is the capital of France?")
    result = coord.answer("Document 1:\nParis\n" + unit * 20, "What is the capital of France?")
    assert result.info["document_tokens"] == len(tok("Document 1:\nParis\n" + unit * 20, add_special_tokens=False)["input_ids"])


def test_chars_per_token_bound_holds_and_is_tight():
    tok = load_tokenizer(None)
    bound = max_chars_per_token(tok)
    assert bound == 16.0  # the longest entry of the shipped vocabulary, "</tool_response>"
    texts = [
        "</tool_response>" * 500,  # the longest token repeated: exactly chars / bound tokens
        " " * 20_000,
        "\n" * 3000 + "a" * 3000,
        "".join(chr(c) for c in range(0x20, 0x3000)),
        "Paris is the capital of France. " * 300,
    ]
    for text in texts:
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        assert n >= len(text) / bound, (text[:30], n)
    assert len(tok(texts[0], add_special_tokens=False)["input_ids"]) == len(texts[0]) / bound


def test_no_bound_when_the_tokenizer_can_drop_text():
    # A whitespace pre-tokenizer deletes spaces: a long run of them is zero tokens, so no bound exists.
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert len(tok(" " * 1000, add_special_tokens=False)["input_ids"]) == 0
    assert max_chars_per_token(tok) is None


def test_text_with_a_lone_surrogate_is_a_clear_error(coord):
    with pytest.raises(InputError, match=r"document is not valid Unicode text: a lone surrogate \(U\+D800\) at character 18"):
        coord.answer("Document 1:\nParis\n\ud800 is in France.", "Where is Paris?")
    with pytest.raises(InputError, match=r"question is not valid Unicode text: a lone surrogate \(U\+DFFF\) at character 6"):
        coord.answer("Document 1:\nParis\nParis is in France.", "Where \udfff is Paris?")
