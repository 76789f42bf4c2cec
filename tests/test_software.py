"""Build records name their software and host; builders pin torch's CPU kernel level."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from coordrl.software import CAPABILITY_ENV, cpu_model, pin_cpu_capability, software


def test_software_names_the_installed_libraries_and_the_kernel_level_torch_runs():
    got = software()
    assert got["libraries"]["torch"] == torch.__version__ == metadata.version("torch")
    assert got["libraries"]["transformers"] == metadata.version("transformers")
    assert got["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert got["python"] == ".".join(map(str, sys.version_info[:3]))


def test_cpu_model_reads_the_model_name_line(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n")
    assert cpu_model(info) == "AMD EPYC 9B14"
    assert cpu_model(tmp_path / "missing")  # falls back to the platform's name, never raises


def test_a_pin_after_torch_ran_a_kernel_is_refused_unless_it_matches(monkeypatch):
    # A copy of the environment for this test: a refused pin has set the variable, and later tests' subprocesses
    # must not inherit it.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != CAPABILITY_ENV})
    torch.ones(4).softmax(0)  # torch has fixed its level in this process
    level = torch.backends.cpu.get_cpu_capability()
    assert pin_cpu_capability("native") == level
    assert pin_cpu_capability(level.lower()) == level
    other = "default" if level != "DEFAULT" else "avx2"
    with pytest.raises(RuntimeError, match=f"--cpu-capability {other}: torch runs its CPU kernels at {level}"):
        pin_cpu_capability(other)


CPUINFO = Path("/proc/cpuinfo")
HAS_AVX2 = CPUINFO.exists() and " avx2" in CPUINFO.read_text(errors="replace")


@pytest.mark.skipif(not HAS_AVX2, reason="needs an x86 CPU with AVX2")
def test_a_fresh_process_pinned_at_avx2_runs_avx2_kernels():
    code = (
        "import torch; from coordrl.software import pin_cpu_capability; "
        "print(pin_cpu_capability('avx2'), torch.backends.cpu.get_cpu_capability())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["AVX2", "AVX2"]
