"""A deterministic, model-free reader: answers with the chunk sentence that best overlaps the query.

It exists so that environments, rewards and training loops can run with no model server at all
(unit tests, CI, smoke runs) while still behaving like a reader: it answers from its chunk only and
abstains with exactly ``Unknown`` when nothing in the chunk is relevant enough.

Scoring: the chunk is split into sentences; each sentence is kept with the title of its paragraph
(chunks hold ``Document i:\\n<title>\\n<sentences>`` blocks) because later sentences of a paragraph
("He lives in Los Angeles.") name their subject only through the title. Query and sentence are
reduced to lowercased content-word sets (stopwords dropped, a light plural stem), each query word is
weighted by an IDF computed over the chunk's sentences, and a sentence scores the fraction of the
query's total weight that it covers. The best sentence (earliest on ties) is the answer when its
score reaches the threshold.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from coordrl.readers.base import UNKNOWN, ReaderRequest, ReaderResult
from coordrl.readers.prompt import sanitize_reader_text

__all__ = ["LexicalReader", "content_words", "split_chunk_sentences", "split_sentences"]

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
# A header only counts at the start of a line, as render_context writes it.
_DOC_HEADER = re.compile(r"^Document \d+:\n", re.MULTILINE)
# A candidate sentence end: terminal punctuation, optional closing quote/bracket, whitespace, then
# something that can start a sentence. Abbreviations are filtered out in split_sentences.
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")
_LAST_WORD = re.compile(r"([^\W\d_]+)\.$")
# Words whose trailing period rarely ends a sentence ("Edward Davis Wood Jr. (October 10, 1924").
_ABBREVIATIONS = frozenset(
    [
        "jr",
        "sr",
        "dr",
        "mr",
        "mrs",
        "ms",
        "st",
        "mt",
        "ft",
        "vs",
        "etc",
        "inc",
        "ltd",
        "co",
        "corp",
        "no",
        "vol",
        "gen",
        "col",
        "lt",
        "sgt",
        "capt",
        "rev",
        "prof",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    ]
)

_STOPWORDS = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "also",
        "am",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "here",
        "hers",
        "herself",
        "him",
        "himself",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "just",
        "me",
        "more",
        "most",
        "my",
        "myself",
        "no",
        "nor",
        "not",
        "now",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "ours",
        "ourselves",
        "out",
        "over",
        "own",
        "same",
        "she",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "themselves",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "whose",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "yourself",
        "yourselves",
        "s",
        "t",
        "d",
        "ll",
        "m",
        "re",
        "ve",
    ]
)


def _stem(word: str) -> str:
    # Only the plural/3rd-person "s": enough to match "lives"/"live", "films"/"film", and it never
    # merges unrelated words the way aggressive suffix stripping does.
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def content_words(text: str) -> frozenset[str]:
    """Lowercased, lightly stemmed word tokens of ``text`` with English stopwords removed."""
    return frozenset(_stem(w) for w in _WORD.findall(text.lower()) if w not in _STOPWORDS)


def split_chunk_sentences(chunk_text: str) -> list[tuple[str, str]]:
    """Split a chunk into ``(title, sentence)`` pairs, in order.

    Each ``Document i:`` block's first line is its title. Text before the first header (a chunk
    that starts in the middle of a paragraph) has no known title: its sentences get ``""``.
    Sentences end at newlines and after ``.``, ``!`` or ``?`` (optionally closed by a quote or
    bracket) followed by whitespace and a capital, digit or opening quote, except after an initial
    or a common abbreviation (``Jr.``, ``Dr.``, ``St.``, ...).
    """
    pieces: list[tuple[str, str]] = []
    headers = list(_DOC_HEADER.finditer(chunk_text))
    if not headers:
        pieces.append(("", chunk_text))
    else:
        if headers[0].start() > 0:
            pieces.append(("", chunk_text[: headers[0].start()]))
        for i, header in enumerate(headers):
            end = headers[i + 1].start() if i + 1 < len(headers) else len(chunk_text)
            block = chunk_text[header.end() : end]
            title, _, body = block.partition("\n")
            pieces.append((title.strip(), body))
    out: list[tuple[str, str]] = []
    for title, body in pieces:
        for line in body.split("\n"):
            out.extend((title, sentence) for sentence in split_sentences(line))
    return out


def split_sentences(text: str) -> list[str]:
    """``text`` cut into its sentences (stripped, empty ones dropped); an initial or a known
    abbreviation followed by a period does not end a sentence."""
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        before = text[start : match.start() + 1]
        last = _LAST_WORD.search(before)
        # An initial ("C. Robert Cargill") or a known abbreviation does not end a sentence.
        if last and text[match.start()] == "." and (len(last.group(1)) == 1 or last.group(1).lower() in _ABBREVIATIONS):
            continue
        sentences.append(text[start : match.end()].strip())
        start = match.end()
    sentences.append(text[start:].strip())
    return [s for s in sentences if s]


@dataclass(frozen=True)
class _Unit:
    title: str
    sentence: str
    words: frozenset[str]


@dataclass(frozen=True)
class _ChunkIndex:
    text: str
    units: tuple[_Unit, ...]
    doc_freq: dict[str, int]

    @classmethod
    def build(cls, chunk_text: str) -> _ChunkIndex:
        units = []
        doc_freq: dict[str, int] = {}
        for title, sentence in split_chunk_sentences(chunk_text):
            words = content_words(title) | content_words(sentence)
            units.append(_Unit(title, sentence, words))
            for w in words:
                doc_freq[w] = doc_freq.get(w, 0) + 1
        return cls(chunk_text, tuple(units), doc_freq)

    def idf(self, word: str) -> float:
        # Words missing from the chunk get the highest weight: a query about something the chunk
        # never mentions should score low, not be ignored.
        return math.log((len(self.units) + 1) / (self.doc_freq.get(word, 0) + 0.5))


class LexicalReader:
    """Model-free :class:`~coordrl.readers.base.ReaderFleet` answering by word overlap.

    Args:
        threshold: minimum score (fraction of the query's IDF weight covered by the best
            sentence plus its title, in [0, 1]) to answer instead of abstaining; default 0.6.
        max_cached_chunks: chunk indexes kept, least recently used evicted; default 4096.

    Answers are ``"<title>: <sentence>"`` (just the sentence when the chunk starts mid-paragraph),
    sanitised with :func:`~coordrl.readers.prompt.sanitize_reader_text`, or exactly
    ``Unknown``. The same request always gets the same answer.
    """

    def __init__(self, threshold: float = 0.6, max_cached_chunks: int = 4096) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if max_cached_chunks < 1:
            raise ValueError(f"max_cached_chunks must be positive, got {max_cached_chunks}")
        self.threshold = threshold
        self.max_cached_chunks = max_cached_chunks
        self._cache: OrderedDict[str, _ChunkIndex] = OrderedDict()

    def __repr__(self) -> str:
        return f"LexicalReader(threshold={self.threshold}, max_cached_chunks={self.max_cached_chunks})"

    def _index(self, chunk_key: str, chunk_text: str) -> _ChunkIndex:
        index = self._cache.get(chunk_key)
        # A reused key with other text must not serve a stale index.
        if index is not None and index.text == chunk_text:
            self._cache.move_to_end(chunk_key)
            return index
        index = _ChunkIndex.build(chunk_text)
        self._cache[chunk_key] = index
        if len(self._cache) > self.max_cached_chunks:
            self._cache.popitem(last=False)
        return index

    def score(self, query: str, chunk_text: str, chunk_key: str | None = None) -> tuple[float, str | None]:
        """The best ``(score, answer)`` for ``query`` over the chunk; answer is None for an empty chunk.

        ``chunk_key`` defaults to the chunk text itself (the index is still cached).
        """
        index = self._index(chunk_key if chunk_key is not None else chunk_text, chunk_text)
        query_words = content_words(query)
        if not query_words or not index.units:
            return 0.0, None
        weights = {w: index.idf(w) for w in query_words}
        total = sum(weights.values())
        best_score, best_unit = -1.0, None
        for unit in index.units:
            covered = sum(weight for word, weight in weights.items() if word in unit.words)
            if covered > best_score:  # strict: the earliest sentence wins ties
                best_score, best_unit = covered, unit
        assert best_unit is not None
        answer = f"{best_unit.title}: {best_unit.sentence}" if best_unit.title else best_unit.sentence
        return best_score / total, sanitize_reader_text(answer)

    def answer_one(self, request: ReaderRequest) -> str:
        """The answer text for one request: the best sentence, or exactly ``Unknown``."""
        score, answer = self.score(request.query, request.chunk_text, request.chunk_key)
        if answer is None or score < self.threshold or score <= 0.0:
            return UNKNOWN
        return answer

    async def answer(self, requests: Sequence[ReaderRequest]) -> list[ReaderResult]:
        """Answer every request, in order. Pure CPU work, so it runs inline on the event loop."""
        return [ReaderResult(text=self.answer_one(r)) for r in requests]

    async def aclose(self) -> None:
        """Drop the cached chunk indexes."""
        self._cache.clear()
