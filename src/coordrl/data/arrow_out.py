"""Streaming a dataset to disk in the layout ``datasets.load_from_disk`` reads.

``Dataset.from_generator`` followed by ``save_to_disk`` writes every byte twice and buffers 1,000
examples per Arrow batch (gigabytes for 6,400-paragraph samples). Here samples go straight into
Arrow shards through datasets' own ``ArrowWriter``, with batches sized in bytes, and the two small
metadata files ``load_from_disk`` needs are written at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from datasets import DatasetInfo, Features, SplitDict, SplitInfo
from datasets.arrow_writer import ArrowWriter

BATCH_BYTES = 32 * 2**20
SHARD_BYTES = 500 * 2**20


def _approx_bytes(example: dict[str, Any]) -> int:
    return sum(len(v) if isinstance(v, str) else 64 for v in example.values())


class DiskDatasetWriter:
    """Write examples into ``folder`` as ``data-0000k-of-0000n.arrow`` shards + state/info files.

    Args:
        folder: an existing, empty folder.
        features: the schema (`coordrl.data.schema.FEATURES`).
        fingerprint: a deterministic id of the content (recipe + seed), stored in ``state.json``.
        shard_bytes: approximate bytes per shard (default 500 MiB, as ``save_to_disk``).
        batch_bytes: approximate bytes buffered before an Arrow batch is flushed (default 32 MiB).
    """

    def __init__(
        self,
        folder: Path,
        features: Features,
        fingerprint: str,
        shard_bytes: int = SHARD_BYTES,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self.folder = Path(folder)
        self.features = features
        self.fingerprint = fingerprint
        self.shard_bytes = shard_bytes
        self.batch_bytes = batch_bytes
        self._writer: ArrowWriter | None = None
        self._shards: list[Path] = []
        self._shard_size = 0
        self.num_examples = 0
        self.num_bytes = 0

    def _open_shard(self, example_bytes: int) -> ArrowWriter:
        path = self.folder / f"data-{len(self._shards):05d}.arrow.partial"
        self._shards.append(path)
        self._shard_size = 0
        batch = max(1, min(1000, self.batch_bytes // max(example_bytes, 1)))
        return ArrowWriter(features=self.features, path=str(path), writer_batch_size=batch)

    def _close_shard(self) -> None:
        if self._writer is not None:
            _, nbytes = self._writer.finalize()
            self.num_bytes += nbytes
            self._writer = None

    def write(self, example: dict[str, Any]) -> None:
        size = _approx_bytes(example)
        if self._writer is not None and self._shard_size + size > self.shard_bytes:
            self._close_shard()
        if self._writer is None:
            self._writer = self._open_shard(size)
        self._writer.write(example)
        self._shard_size += size
        self.num_examples += 1

    def close(self) -> None:
        """Finish the last shard, give shards their final names and write state.json and dataset_info.json."""
        if self._writer is None and not self._shards:
            self._writer = self._open_shard(1)  # an empty dataset still gets one (empty) shard
        self._close_shard()
        n = len(self._shards)
        names = []
        for i, path in enumerate(self._shards):
            final = self.folder / f"data-{i:05d}-of-{n:05d}.arrow"
            path.rename(final)
            names.append(final.name)
        splits = SplitDict()
        splits.add(SplitInfo(name="train", num_bytes=self.num_bytes, num_examples=self.num_examples))
        DatasetInfo(
            features=self.features, splits=splits, dataset_size=self.num_bytes, size_in_bytes=self.num_bytes
        ).write_to_directory(str(self.folder))
        state = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": self.fingerprint,
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": "train",
        }
        (self.folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
