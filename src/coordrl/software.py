"""What software and host a build or run used, for its record, and the CPU kernels it runs.

A resource build (the world warm starts, the world reader) is byte-identical from run to run on one
host, yet the same recipe gave other weights on a host whose cores report the same model name: torch
dispatches its CPU kernels to the widest SIMD level the CPU has (AVX2, AVX-512, ...), and float sums
come out differently at each. `pin_cpu_capability` holds a process at one level, so a build repeats on
any host that has it; every build and learning-check record carries `software()`, so two records that
disagree can be told apart by what differed.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from coordrl import __version__

# torch reads this once, at its first CPU kernel dispatch, and never again in that process.
CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"

# The libraries whose numerics or sampling shape a build's weights or a run's figures.
LIBRARIES = ("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "safetensors", "numpy")


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), else `platform.processor()`."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def software() -> dict[str, Any]:
    """``{"coordrl", "python", "libraries": {name: version or None}, "machine", "cpu", "torch_cpu_capability"}``.

    ``torch_cpu_capability`` is the SIMD level torch dispatches its CPU kernels to (``AVX2``,
    ``AVX512``, ...): two hosts that report the same CPU model string can still differ there, and the
    float sums differ with it. None when torch is not installed.
    """
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        capability = None
    return {
        "coordrl": __version__,
        "python": platform.python_version(),
        "libraries": {name: _installed(name) for name in LIBRARIES},
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "torch_cpu_capability": capability,
    }


def add_capability_flag(parser, kept: str) -> None:
    """Give a resource builder's argument parser ``--cpu-capability``, defaulting to ``kept``: the level
    its kept resource was built at, so the defaults rebuild it byte for byte."""
    parser.add_argument(
        "--cpu-capability",
        default=kept,
        help=f"SIMD level of torch's CPU kernels, pinned for the whole build (default {kept}: the kept build's, "
        "so the defaults rebuild it byte for byte; other levels give other weights; native: the CPU's widest)",
    )


def pin_cpu_capability(level: str) -> str:
    """Make torch run its CPU kernels at SIMD ``level`` (``avx2``, ``avx512``, ...; ``native``: leave
    torch its own choice) for the rest of this process, and return the level torch reports.

    Call it before the process runs any torch operation: torch fixes the level at its first kernel
    dispatch. Raises RuntimeError when torch does not then report ``level`` (a CPU without it, or a
    process that already ran a kernel), since a build at another level gives other weights.
    """
    import torch

    if level != "native":
        os.environ[CAPABILITY_ENV] = level
    got = torch.backends.cpu.get_cpu_capability()
    if level != "native" and got.lower() != level.lower():
        raise RuntimeError(
            f"--cpu-capability {level}: torch runs its CPU kernels at {got} here (a CPU without {level}, or "
            f"torch ran before the pin); the weights would differ from a {level} build. Use --cpu-capability "
            f"native to build at {got} anyway"
        )
    return got
