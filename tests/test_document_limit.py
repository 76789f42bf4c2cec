"""Over-long documents are refused from their length, before tokenization; near the limit, exactly."""

from __future__ import annotations

import tracemalloc

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from coordrl.data.tokens import count_tokens_up_to, load_tokenizer, max_chars_per_token
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
    with pytest.raises(InputError, match=r"document has at least [\d,]+ tokens, more than the limit of 50,000"):
        coord.answer(over, "What is the capital of France?")
    result = coord.answer("Document 1:\nParis\n" + unit * 20, "What is the capital of France?")
    assert result.info["document_tokens"] == len(
        tok("Document 1:\nParis\n" + unit * 20, add_special_tokens=False)["input_ids"]
    )


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
    with pytest.raises(
        InputError, match=r"document is not valid Unicode text: a lone surrogate \(U\+D800\) at character 18"
    ):
        coord.answer("Document 1:\nParis\n\ud800 is in France.", "Where is Paris?")
    with pytest.raises(
        InputError, match=r"question is not valid Unicode text: a lone surrogate \(U\+DFFF\) at character 6"
    ):
        coord.answer("Document 1:\nParis\nParis is in France.", "Where \udfff is Paris?")


def test_windowed_count_is_exact_and_stops_past_the_limit():
    tok = load_tokenizer(None)
    paragraphs = [
        f"Document {i}:\nTitle {i}\nTitle {i} was founded in {1900 + i} by Person {i}; café ☕ naïve  spaces.\n"
        for i in range(400)
    ]
    text = "\n".join(paragraphs) + "\n\n   \n" + "tail " * 50
    exact = len(tok(text, add_special_tokens=False)["input_ids"])
    for window in (97, 1000, 5000, len(text)):  # many cuts, a few, none
        assert count_tokens_up_to(tok, text, limit=10**9, window_chars=window) == exact
    stopped = count_tokens_up_to(tok, text, limit=exact // 4, window_chars=1000)
    assert exact // 4 < stopped < exact // 2  # it stopped soon after the limit
    no_cut = "word " * 5000  # no newline to cut at: counted whole
    assert count_tokens_up_to(tok, no_cut, limit=10, window_chars=100) == len(
        tok(no_cut, add_special_tokens=False)["input_ids"]
    )


def test_without_a_length_bound_an_over_long_document_is_counted_in_windows(coord):
    # As with a tokenizer whose longest token is long (a weak length bound): the count stops past the limit.
    document = "Document 1:\nTitle\n" + "Paris is the capital of France.\n" * 100_000  # 3.2 M characters
    coord._chars_per_token = None
    try:
        tracemalloc.start()
        with pytest.raises(
            InputError, match=r"document has at least [\d,]+ tokens, more than the limit of 50,000"
        ) as err:
            coord.answer(document, "What is the capital of France?")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        coord._chars_per_token = max_chars_per_token(coord.tokenizer)
    assert peak < 2 * len(document), f"peak {peak:,} B traced for a {len(document):,} B document"
    counted = int(str(err.value).split()[4].replace(",", ""))
    assert 50_000 < counted < 200_000  # of ~700K: it stopped a window past the limit
