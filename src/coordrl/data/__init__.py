"""Datasets: distractor-packed HotpotQA / 2WikiMultiHopQA samples, length sweeps and reader chunks."""

from coordrl.data.build import BuildConfig, SweepConfig, build_dataset, build_sweep
from coordrl.data.chunk import Chunk, chunk_context
from coordrl.data.errors import BadRecordError, DataError
from coordrl.data.layout import Paragraph, render_context
from coordrl.data.pack import PackSpec, Placement, pack_sample
from coordrl.data.records import QARecord, load_records

__all__ = [
    "BadRecordError",
    "BuildConfig",
    "Chunk",
    "DataError",
    "PackSpec",
    "Paragraph",
    "Placement",
    "QARecord",
    "SweepConfig",
    "build_dataset",
    "build_sweep",
    "chunk_context",
    "load_records",
    "pack_sample",
    "render_context",
]
