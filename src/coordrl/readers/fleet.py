"""Building a reader fleet from a user-facing spec: ``lexical`` or a comma-separated URL list."""

from __future__ import annotations

from typing import Any

from coordrl.readers.base import ReaderFleet
from coordrl.readers.lexical import LexicalReader


def make_fleet(readers: str, model: str | None = None, **options: Any) -> ReaderFleet:
    """A reader fleet.

    Args:
        readers: ``lexical`` (model-free, deterministic) or ``http://host:port[,http://host2:port...]``
            (OpenAI-compatible servers, e.g. from ``coordrl serve-readers``).
        model: the served model name (required for URLs).
        options: passed to `OpenAIReaderFleet` (``max_concurrency``, ``timeout_s``, ``max_retries``,
            ``max_tokens``, ``api_key_env``, ...) or `LexicalReader` (``threshold``).
    """
    spec = readers.strip()
    if spec == "lexical":
        allowed = {k: v for k, v in options.items() if k in ("threshold",)}
        return LexicalReader(**allowed)
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise ValueError(f"--readers must be 'lexical' or comma-separated http(s) URLs, got {readers!r}")
    if not model:
        raise ValueError("reader URLs need the served model name (--reader-model)")
    # Lazy: the HTTP fleet loads aiohttp, which a lexical run never needs.
    from coordrl.readers.openai_fleet import OpenAIReaderFleet

    return OpenAIReaderFleet(urls, model, **{k: v for k, v in options.items() if k != "threshold"})
