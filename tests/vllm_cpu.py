"""The vLLM CPU build for the integration tests: which interpreter has it, and a free loopback port.

``scripts/test.sh`` sets up ``.venv-vllm``; ``$COORDRL_VLLM_PYTHON`` names another interpreter. Tests
that need it are skipped, with the way to get it, when there is none."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@functools.cache  # importing vllm takes seconds; probe once per test session
def vllm_python() -> str | None:
    """An interpreter that imports vllm, or None."""
    candidate = os.environ.get("COORDRL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(candidate).exists():
        return None
    probe = subprocess.run([candidate, "-c", "import vllm"], check=False, capture_output=True, timeout=300)
    return candidate if probe.returncode == 0 else None


def vllm_python_or_skip() -> str:
    python = vllm_python()
    if python is None:
        pytest.skip(
            "no interpreter with vllm: run scripts/setup_vllm_cpu.sh (creates .venv-vllm) or set COORDRL_VLLM_PYTHON"
        )
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
