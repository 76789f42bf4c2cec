"""Paragraph text and the "Document i:" context layout (the MemAgent Stage-I layout).

Paragraph text is the title, a newline, then the sentences concatenated as given. HotpotQA sentences
carry their own leading spaces; 2WikiMultiHopQA ones do not, so a space is inserted only where two
sentences would otherwise touch (this reproduces HotpotQA's plain concatenation exactly).
The context is ``"Document {i}:\\n{paragraph}"`` for i = 1..N joined by blank lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DOC_SEPARATOR = "\n\n"


def join_sentences(sentences: Sequence[str]) -> str:
    """Concatenate sentences, adding a space only where neither side brings whitespace."""
    out: list[str] = []
    for sentence in sentences:
        if out and sentence and not out[-1][-1:].isspace() and not sentence[:1].isspace():
            out.append(" ")
        out.append(sentence)
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Paragraph:
    """One titled paragraph. ``body`` is the sentence text without the title."""

    title: str
    body: str

    @property
    def text(self) -> str:
        return f"{self.title}\n{self.body}"


def document_header(index: int) -> str:
    """Header of the 1-based Document ``index``."""
    return f"Document {index}:\n"


def render_context(paragraphs: Sequence[Paragraph]) -> tuple[str, list[int]]:
    """Render the context and return it with the character offset where each Document starts.

    Returns:
        ``(context, doc_offsets)`` where ``doc_offsets[i]`` is the offset of ``"Document {i+1}:"``.
        The offsets come from rendering, never from parsing, so document text that imitates a header
        cannot shift Document numbers.
    """
    parts: list[str] = []
    offsets: list[int] = []
    pos = 0
    for i, paragraph in enumerate(paragraphs, start=1):
        if i > 1:
            parts.append(DOC_SEPARATOR)
            pos += len(DOC_SEPARATOR)
        offsets.append(pos)
        piece = document_header(i) + paragraph.text
        parts.append(piece)
        pos += len(piece)
    return "".join(parts), offsets
