"""Reader activation: wake only the chunk readers a query is likely to concern.

PARSER broadcasts every query to every chunk reader, so a 1M-token document at 4,096-token chunks
costs about 250 reader calls per query, nearly all of them "Unknown". Following E-mem's
multi-pathway activation, a query is routed through several cheap pathways, each proposing its
top-k chunks, and the union of their proposals is activated:

- ``bm25``: symbolic BM25 (`bm25s`) over the chunks' full text: exact rare terms anywhere in a chunk.
- ``summary``: BM25 over a short lexical summary of each chunk (its paragraph titles, each
  paragraph's first sentence and its most repeated names). The summary is the "global alignment"
  pathway: a long chunk full of other topics still matches a query about one of its paragraphs'
  subjects, where the chunk-level BM25 score is diluted.
- ``dense``: cosine similarity of query and chunk embeddings from an OpenAI-compatible
  ``/v1/embeddings`` endpoint (optional; off unless ``dense_top_k`` > 0 and a URL is given).

A pathway only proposes chunks it scores above zero: a query sharing no term with a chunk never
wakes it through a lexical pathway. Ties are broken by chunk order, so routing is deterministic.

An index is built once per document (chunk texts and settings) and kept in a `RouterCache`, like
the environment's chunk cache: GRPO runs several rollouts on the same sample, and every query after
the first only pays for scoring (well under a millisecond at 250 chunks).
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from coordrl.readers.retry import DEFAULT_TIMEOUT_S

__all__ = [
    "ACTIVATIONS",
    "PATHWAYS",
    "ChunkRouter",
    "EmbeddingClient",
    "RouteResult",
    "RouterCache",
    "RouterSettings",
    "chunk_summaries",
]

ACTIVATIONS = ("all", "routed")
PATHWAYS = ("bm25", "summary", "dense")

# A document header as coordrl's data layout writes it (`Document 12:` on its own line, then the title).
_DOC_HEADER = re.compile(r"^Document \d+:\n", re.MULTILINE)
_BLOCK_BREAK = re.compile(r"\n[ \t]*\n")
# A sentence ends at . ! or ? (optionally closed by a quote or bracket) before whitespace and a capital or digit.
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?=\s+[\"'“‘(\[]?[A-Z0-9])")
# A run of capitalised words ("Shirley Temple", "Kiss and Tell" is two runs; both keep their terms).
_NAME = re.compile(r"\b[A-Z][\w'’\-]*(?:[ \t]+[A-Z][\w'’\-]*)*")
# A title's trailing disambiguation ("Kiss and Tell (1945 film)"): queries name the subject without it.
_DISAMBIGUATION = re.compile(r"\s*\([^()]*\)\s*$")
_MAX_TITLE_WORDS = 12
_MAX_SENTENCE_CHARS = 240


@dataclass(frozen=True)
class RouterSettings:
    """How queries are routed to chunks. A pathway with top-k 0 is switched off.

    Attributes:
        bm25_top_k: chunks proposed by BM25 over the chunk texts (default 8).
        summary_top_k: chunks proposed by BM25 over the chunk summaries (default 8).
        dense_top_k: chunks proposed by embedding similarity (default 0: off; needs ``dense_url``).
        dense_url: base URL of an OpenAI-compatible server with ``/v1/embeddings`` (default None).
        dense_model: the embedding model name served at ``dense_url`` (default None: required with a URL).
        dense_timeout_s: timeout of one embeddings request (default 60 s).
        summary_names: most repeated names kept in a chunk's summary (default 8).
    """

    bm25_top_k: int = 8
    summary_top_k: int = 8
    dense_top_k: int = 0
    dense_url: str | None = None
    dense_model: str | None = None
    dense_timeout_s: float = DEFAULT_TIMEOUT_S
    summary_names: int = 8

    def __post_init__(self) -> None:
        for name in ("bm25_top_k", "summary_top_k", "dense_top_k", "summary_names"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 switches it off), got {value!r}")
        if not self.pathways:
            raise ValueError("routing needs at least one pathway: bm25_top_k, summary_top_k or dense_top_k > 0")
        if self.dense_top_k:
            if not self.dense_url or not self.dense_url.startswith(("http://", "https://")):
                raise ValueError(
                    f"dense_top_k > 0 needs dense_url, an http(s) embeddings server, got {self.dense_url!r}"
                )
            if not self.dense_model:
                raise ValueError("dense_top_k > 0 needs dense_model, the embedding model served at dense_url")
        if self.dense_timeout_s <= 0:
            raise ValueError(f"dense_timeout_s must be > 0 seconds, got {self.dense_timeout_s}")

    @property
    def pathways(self) -> tuple[str, ...]:
        """The pathways switched on, in `PATHWAYS` order."""
        k = {"bm25": self.bm25_top_k, "summary": self.summary_top_k, "dense": self.dense_top_k}
        return tuple(p for p in PATHWAYS if k[p] > 0)

    def top_k(self, pathway: str) -> int:
        return {"bm25": self.bm25_top_k, "summary": self.summary_top_k, "dense": self.dense_top_k}[pathway]

    def index_key(self) -> tuple:
        """What an index depends on (top-k only matters at query time, so indexes are shared across it)."""
        dense = (self.dense_url, self.dense_model) if self.dense_top_k else None
        return (self.bm25_top_k > 0, self.summary_top_k > 0, self.summary_names, dense)


@dataclass(frozen=True)
class RouteResult:
    """The chunks one query activates: their union (in document order), each pathway's proposal, and
    the error of each pathway that failed (the dense pathway's server); ``fallback`` is True when every
    pathway on failed and the query went to all chunks instead."""

    chunks: tuple[int, ...]
    by_pathway: dict[str, tuple[int, ...]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    fallback: bool = False


# -- summaries ---------------------------------------------------------------------------------------


def _stem(words: list[str]) -> list[str]:
    # Only the plural/3rd-person "s" (as the lexical reader does): "films" meets "film" without
    # merging unrelated words the way aggressive suffix stripping does.
    return [w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")) else w for w in words]


def _first_sentence(body: str) -> str:
    body = " ".join(body.split())
    end = _SENTENCE_END.search(body)
    sentence = body[: end.end()] if end else body
    if len(sentence) > _MAX_SENTENCE_CHARS:
        sentence = sentence[:_MAX_SENTENCE_CHARS].rsplit(" ", 1)[0]
    return sentence


def _blocks(text: str, fresh: bool) -> tuple[str, list[tuple[str, str]]]:
    """``(lead, [(title, body), ...])`` of a chunk: ``lead`` is text before its first paragraph start
    (the tail of a paragraph the previous chunk began; none when ``fresh``, a chunk that starts at a
    paragraph break); titles are "" where a paragraph has none."""
    headers = list(_DOC_HEADER.finditer(text))
    if headers:  # coordrl's layout: `Document i:` then the title line, then the paragraph
        lead = text[: headers[0].start()]
        out = []
        for i, h in enumerate(headers):
            block = text[h.end() : headers[i + 1].start() if i + 1 < len(headers) else len(text)]
            title, _, body = block.partition("\n")
            out.append((title.strip(), body))
        return lead, out
    # Any other document: blank-line paragraphs; a short first line followed by more text is a heading.
    parts = _BLOCK_BREAK.split(text)
    lead, rest = ("", parts) if fresh else (parts[0], parts[1:])
    out = []
    for block in rest:
        first, _, body = block.strip().partition("\n")
        if body.strip() and len(first.split()) <= _MAX_TITLE_WORDS and not first.rstrip().endswith((".", ":", ";")):
            out.append((first.strip(), body))
        elif block.strip():
            out.append(("", block))
    return lead, out


def _starts_paragraph(previous: str, text: str) -> bool:
    """Whether a chunk starts a paragraph: it is the first, or a blank line spans the cut before it."""
    if not previous:
        return True
    tail, head = previous[-16:], text[:16]
    cut = len(tail)
    return any(m.start() <= cut <= m.end() for m in _BLOCK_BREAK.finditer(tail + head))


def _summarise(texts: Sequence[str], names: int) -> list[tuple[list[str], str]]:
    """``(titles, summary text)`` of each chunk (see `chunk_summaries`)."""
    out: list[tuple[list[str], str]] = []
    carried = ""
    previous = ""
    for text in texts:
        lead, blocks = _blocks(text, fresh=_starts_paragraph(previous, text))
        previous = text
        titles: list[str] = []
        sentences: list[str] = []
        if lead.strip():
            if carried:
                titles.append(carried)
            sentences.append(_first_sentence(lead))
        for title, body in blocks:
            if title:
                titles.append(title)
            if body.strip():
                sentences.append(_first_sentence(body))
        if blocks:  # the last paragraph's title, for a next chunk that starts inside it
            carried = blocks[-1][0]
        counts = Counter(m.group(0) for m in _NAME.finditer(text))
        seen = set(titles)
        salient = [n for n, c in counts.most_common() if c > 1 and n not in seen][:names]
        out.append((titles, " ".join([*titles, *titles, *salient, *sentences])))
    return out


def chunk_summaries(texts: Sequence[str], names: int = 8) -> list[str]:
    """A short lexical summary of each chunk, in order.

    A summary lists the chunk's paragraph titles (twice, so a title term outweighs the same word in a
    sentence), the ``names`` capitalised names the chunk repeats most, and each paragraph's first
    sentence. A chunk that starts inside a paragraph carries that paragraph's title from the chunk
    before, since its sentences ("She served as ...") name their subject only through the title.
    """
    return [text for _, text in _summarise(texts, names)]


# -- pathways ----------------------------------------------------------------------------------------


def _terms(texts: list[str]) -> list[list[str]]:
    import bm25s  # 0.3 s to import; only routed episodes need it, not every command that loads the envs

    return bm25s.tokenize(texts, stopwords="en", stemmer=_stem, return_ids=False, show_progress=False)


class _Bm25:
    """BM25 over a list of texts (`bm25s`, English stopwords, the light plural stem)."""

    def __init__(self, texts: Sequence[str]) -> None:
        import bm25s

        tokens = bm25s.tokenize(list(texts), stopwords="en", stemmer=_stem, show_progress=False)
        self.vocab: dict[str, int] = tokens.vocab
        self.n = len(texts)
        self.doc_freq = Counter(t for ids in tokens.ids for t in set(ids))
        self.model = bm25s.BM25()
        self.model.index(tokens, show_progress=False)

    def scores(self, terms: list[str]) -> np.ndarray:
        ids = [self.vocab[t] for t in terms if t in self.vocab]
        if not ids:
            return np.zeros(self.n, dtype=np.float32)
        return self.model.get_scores(ids)

    def idf(self, term: str) -> float:
        return float(np.log((self.n + 1) / (self.doc_freq.get(self.vocab.get(term, -1), 0) + 0.5)))


class _SummaryIndex:
    """The summary pathway: a chunk whose paragraph title the query names in full ranks first (by the
    title terms' rarity), then BM25 over the summaries orders the rest and breaks ties.

    Naming a paragraph's subject ("Scott Derrickson", "Kiss and Tell") is the strongest sign a query
    concerns it; BM25 alone lets a distractor that mentions the name in a few sentences outrank the
    paragraph about it.
    """

    def __init__(self, texts: Sequence[str], names: int) -> None:
        summaries = _summarise(texts, names)
        self.bm25 = _Bm25([text for _, text in summaries])
        self.n = len(texts)
        self._titles: list[tuple[int, frozenset[str]]] = []
        self._by_term: dict[str, list[int]] = {}
        all_titles = [(i, _DISAMBIGUATION.sub("", t)) for i, (titles, _) in enumerate(summaries) for t in titles]
        for (chunk, _), terms in zip(all_titles, _terms([t for _, t in all_titles]) if all_titles else []):
            if terms:
                for term in set(terms):
                    self._by_term.setdefault(term, []).append(len(self._titles))
                self._titles.append((chunk, frozenset(terms)))

    def scores(self, terms: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(title score, BM25 score)`` per chunk."""
        named = np.zeros(self.n, dtype=np.float32)
        query = set(terms)
        for t in {t for term in query for t in self._by_term.get(term, ())}:
            chunk, title = self._titles[t]
            if title <= query:
                named[chunk] = max(named[chunk], sum(self.bm25.idf(w) for w in title))
        return named, self.bm25.scores(terms)


class EmbeddingClient:
    """``POST {url}/v1/embeddings`` of an OpenAI-compatible server (vLLM's pooling runner, for one).

    Texts are sent in batches; the returned vectors are L2-normalised so a dot product is the cosine.
    Each request asks for vLLM's ``truncate_prompt_tokens: -1``: a 4,096-token chunk is longer than
    many embedding models' context, and the server then embeds its first max-model-len tokens
    instead of refusing it. Calls are synchronous: the index is built once per document, and a query
    is one small request. One keep-alive connection serves every call until `close`, so a routed
    query does not pay a new TCP connection.
    """

    def __init__(self, url: str, model: str, timeout_s: float = 60.0, batch: int = 64) -> None:
        self.url = url.rstrip("/").removesuffix("/v1") + "/v1/embeddings"
        self.model = model
        self.timeout_s = timeout_s
        self.batch = batch
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()  # httpx.Client is not shared across threads mid-request

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors of ``texts`` (one row each). RuntimeError naming the server when it fails."""
        rows: list[list[float]] = []
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=self.timeout_s)
            client = self._client
            for i in range(0, len(texts), self.batch):
                part = list(texts[i : i + self.batch])
                try:
                    resp = client.post(
                        self.url, json={"model": self.model, "input": part, "truncate_prompt_tokens": -1}
                    )
                    resp.raise_for_status()
                    data = sorted(resp.json()["data"], key=lambda d: d["index"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    raise RuntimeError(f"embeddings server {self.url} failed: {type(e).__name__}: {e}") from None
                if len(data) != len(part):
                    raise RuntimeError(
                        f"embeddings server {self.url} returned {len(data)} vectors for {len(part)} texts"
                    )
                rows += [d["embedding"] for d in data]
        matrix = np.asarray(rows, dtype=np.float32)
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix / np.maximum(norms, 1e-12)


def _top(scores: np.ndarray, k: int, first: np.ndarray | None = None) -> tuple[int, ...]:
    """The ``k`` best chunks with a positive score, ranked by ``first`` (when given) and then ``scores``;
    equal scores go to the earlier chunk."""
    keep = scores > 0 if first is None else (scores > 0) | (first > 0)
    candidates = np.flatnonzero(keep)
    if not len(candidates):
        return ()
    keys = (candidates, -scores[candidates]) + (() if first is None else (-first[candidates],))
    order = np.lexsort(keys)  # the last key sorts first
    return tuple(int(i) for i in candidates[order[:k]])


class ChunkRouter:
    """The routing index of one document: built once from its chunk texts, then queried.

    Args:
        texts: the document's chunks, in order.
        settings: which pathways are on and their top-k.
        embedder: the dense pathway's client (built from the settings when None and dense is on).
    """

    def __init__(self, texts: Sequence[str], settings: RouterSettings, embedder: EmbeddingClient | None = None) -> None:
        t0 = time.perf_counter()
        self.settings = settings
        self.n_chunks = len(texts)
        self._bm25 = _Bm25(texts) if settings.bm25_top_k else None
        self._summary = _SummaryIndex(texts, settings.summary_names) if settings.summary_top_k else None
        self._embedder = None
        self._vectors = None
        self.dense_error: str | None = None
        if settings.dense_top_k:
            self._embedder = embedder or EmbeddingClient(
                settings.dense_url or "", settings.dense_model or "", settings.dense_timeout_s
            )
            try:
                self._vectors = self._embedder.embed(texts)
            except RuntimeError as e:
                # Remembered for this document's index: retrying every query would cost a timeout each.
                self.dense_error = str(e)
        self.build_seconds = time.perf_counter() - t0

    def route(self, query: str, settings: RouterSettings | None = None) -> RouteResult:
        """The chunks ``query`` activates: each pathway's top-k, and their union in document order.

        ``settings`` may change top-k (0 switches a pathway off) but not turn on a pathway this index
        was built without.
        """
        s = settings or self.settings
        by: dict[str, tuple[int, ...]] = {}
        errors: dict[str, str] = {}
        terms = _terms([query])[0] if self._bm25 is not None or self._summary is not None else []
        for pathway in s.pathways:
            k = s.top_k(pathway)
            if pathway == "bm25":
                if self._bm25 is None:
                    raise ValueError("this index was built without the bm25 pathway")
                by[pathway] = _top(self._bm25.scores(terms), k)
            elif pathway == "summary":
                if self._summary is None:
                    raise ValueError("this index was built without the summary pathway")
                named, scores = self._summary.scores(terms)
                by[pathway] = _top(scores, k, first=named)
            else:
                if self._embedder is None:
                    raise ValueError("this index was built without the dense pathway")
                if self._vectors is None:
                    errors[pathway] = f"chunk embeddings unavailable: {self.dense_error}"
                    continue
                try:
                    q = self._embedder.embed([query])[0]
                except RuntimeError as e:
                    errors[pathway] = str(e)
                    continue
                # Cosine similarity can be negative; shift so every chunk is a candidate, ranked by similarity.
                by[pathway] = _top(self._vectors @ q + 1.0, k)
        if errors and not by:
            # No pathway could answer: wake every reader rather than silently hide the document.
            return RouteResult(tuple(range(self.n_chunks)), by, errors, fallback=True)
        union = sorted({i for chunks in by.values() for i in chunks})
        return RouteResult(tuple(union), by, errors)


def document_key(chunk_keys: Sequence[str]) -> str:
    """A key for a document from its chunks' content keys (same chunks, same key)."""
    return hashlib.sha1("\n".join(chunk_keys).encode()).hexdigest()


class RouterCache:
    """Routing indexes of recent documents, least recently used evicted.

    GRPO resets several rollouts on one sample and evaluation asks many queries of one document; the
    index (tokenising every chunk) is the costly part, so it is built once per document and settings.
    Indexes are read-only after they are built, so rollouts share them; one lock serialises building,
    so concurrent rollouts on a new document build it once.
    """

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, ChunkRouter] = OrderedDict()
        # One embeddings client per (url, model, timeout): every document's router shares its connection.
        self._embedders: dict[tuple, EmbeddingClient] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.builds = 0

    def get(self, doc_key: str, texts: Sequence[str], settings: RouterSettings) -> ChunkRouter:
        key = (doc_key, settings.index_key())
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
            embedder = None
            if settings.dense_top_k:
                ekey = (settings.dense_url, settings.dense_model, settings.dense_timeout_s)
                if ekey not in self._embedders:
                    self._embedders[ekey] = EmbeddingClient(
                        settings.dense_url or "", settings.dense_model or "", settings.dense_timeout_s
                    )
                embedder = self._embedders[ekey]
            router = ChunkRouter(texts, settings, embedder)
            self.builds += 1
            if self.max_entries > 0:
                self._entries[key] = router
                if len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            return router

    def close(self) -> None:
        """Close the embeddings connections (the indexes need no closing)."""
        with self._lock:
            for embedder in self._embedders.values():
                embedder.close()
