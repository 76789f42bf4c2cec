"""Datasets: distractor-packed HotpotQA / 2WikiMultiHopQA samples, length sweeps and reader chunks."""

from coordrl.data.build import BuildConfig, SweepConfig, build_dataset, build_sweep
from coordrl.data.chunk import Chunk, chunk_context
from coordrl.data.errors import BadRecordError, DataError
from coordrl.data.layout import Paragraph, render_context
from coordrl.data.pack import PackSpec, Placement, pack_sample
from coordrl.data.records import QARecord, load_records

__all__ = [
    "BuildConfig",
    "SweepConfig",
    "build_dataset",
    "build_sweep",
    "Chunk",
    "chunk_context",
    "BadRecordError",
    "DataError",
    "Paragraph",
    "render_context",
    "PackSpec",
    "Placement",
    "pack_sample",
    "QARecord",
    "load_records",
]
