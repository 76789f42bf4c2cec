"""Evaluation traces: one JSON line per finished sample in ``traces/<subset>.jsonl``, flushed at once,
so an interrupted run resumes from what is on disk; the latest record of a sample id counts."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from coordrl.rundir import truncate_torn_tail

__all__ = ["TraceWriter", "read_traces"]


def read_traces(path: Path) -> dict[str, dict[str, Any]]:
    """Latest record per sample id of a trace file; a torn last line (crash mid-write) is ignored."""
    latest: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return latest
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                latest[str(rec["id"])] = rec
    return latest


class TraceWriter:
    """Appends one JSON line per finished sample, flushed at once (that is what makes resuming safe)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._checked: set[str] = set()

    def write(self, subset: str, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        path = self.folder / f"{subset}.jsonl"
        with self._lock:
            if subset not in self._checked:
                self._checked.add(subset)
                # A crash mid-write leaves a torn last line: cut it, so the file stays valid JSONL (the
                # sample it held has no complete record, so this run does it again).
                truncate_torn_tail(path)
            # A lone surrogate (a policy's tool-call JSON can spell one) is written as its JSON escape.
            with open(path, "a", encoding="utf-8", errors="backslashreplace") as fh:
                fh.write(line)
                fh.flush()
