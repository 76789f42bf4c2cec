"""Process management of serve.py without vLLM: a stand-in interpreter runs FaultInjectingFakeServer.

The stand-in receives the exact vLLM command line (``-m vllm.entrypoints.openai.api_server --model
... --port P ...``), so these tests check command building, per-GPU environment, health waiting,
error reporting, URL files and process-group shutdown. The real server is covered by
test_vllm_cpu_integration.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordrl.readers.serve import (
    ReaderServerError,
    start_reader_servers,
    vllm_server_command,
)

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = Path(__file__).resolve().parent

FAKE_PYTHON = f"""#!{sys.executable}
# Stand-in for a vLLM interpreter: FAKE_MODE=ok serves, die exits at once, hang never listens.
import json, os, subprocess, sys, threading, time
sys.path.insert(0, {str(TESTS_DIR)!r})
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
out = os.environ["FAKE_OUT"]
child = subprocess.Popen(["sleep", "300"])  # a worker process, as vLLM's engine core would be
with open(os.path.join(out, f"fake-{{port}}.json"), "w") as fh:
    json.dump({{"argv": args, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "child": child.pid}}, fh)
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "die":
    print("boom: simulated CUDA out of memory", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(300)
from fault_injecting_server import FaultInjectingFakeServer
FaultInjectingFakeServer(port=port).start()
print("fake server up", flush=True)
threading.Event().wait()
"""


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    python = tmp_path / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_OUT", str(tmp_path))
    return python


def _record(tmp_path: Path, port: int) -> dict:
    import json

    return json.loads((tmp_path / f"fake-{port}.json").read_text())


def test_command_line():
    assert vllm_server_command("py", "/m", 8100) == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.0.0.1", "--port", "8100",
        "--enable-prefix-caching",
    ]  # fmt: skip
    cpu = vllm_server_command("py", "/m", 8100, cpu=True, max_model_len=2048, extra_args=["--seed", "1"])
    assert cpu[-10:] == [
        "--dtype",
        "float32",
        "--gpu-memory-utilization",
        "0.2",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
        "--seed",
        "1",
    ]
    overridden = vllm_server_command(
        "py", "/m", 1, cpu=True, extra_args=["--dtype=bfloat16", "--gpu-memory-utilization", "0.5"]
    )
    assert overridden.count("--gpu-memory-utilization") == 1 and "float32" not in overridden
    own_blocks = vllm_server_command("py", "/m", 1, cpu=True, extra_args=["--block-size", "128"])
    assert own_blocks.count("--block-size") == 1 and own_blocks[-2:] == ["--block-size", "128"]
    assert "--block-size" not in vllm_server_command("py", "/m", 1)  # GPUs keep vLLM's default


def test_one_server_per_gpu_then_clean_stop(fake, tmp_path):
    port = _free_port_pair()
    group = start_reader_servers(
        "/models/reader", [3, 5], port_base=port, python=str(fake), log_dir=tmp_path, startup_timeout_s=60
    )
    try:
        assert group.urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        records = [_record(tmp_path, port), _record(tmp_path, port + 1)]
        assert [r["cuda"] for r in records] == ["3", "5"]
        assert records[0]["argv"][:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/reader"]
        assert all(s.healthy() for s in group.servers)
    finally:
        group.stop(grace_s=5)
    for r in records:
        assert _wait_dead(r["pid"]) and _wait_dead(r["child"]), "a server or its worker survived stop()"


def test_server_dying_at_startup_is_named_with_its_log(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "die")
    with pytest.raises(ReaderServerError) as err:
        start_reader_servers(
            "/m", [7], port_base=_free_port_pair(), python=str(fake), log_dir=tmp_path, startup_timeout_s=60
        )
    message = str(err.value)
    assert "gpu7" in message and "exited with code 3" in message and "boom: simulated CUDA out of memory" in message


def test_startup_timeout_stops_everything(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang")
    port = _free_port_pair()
    with pytest.raises(ReaderServerError, match=r"cpu.*not healthy after 2s"):
        start_reader_servers("/m", cpu=True, port_base=port, python=str(fake), log_dir=tmp_path, startup_timeout_s=2)
    record = _record(tmp_path, port)
    assert record["cuda"] == ""  # CPU mode hides GPUs
    assert _wait_dead(record["pid"]) and _wait_dead(record["child"])


def test_port_in_use_is_refused(fake, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ReaderServerError, match="already in use"):
            start_reader_servers(
                "/m", cpu=True, port_base=port, python=str(fake), log_dir=tmp_path, startup_timeout_s=10
            )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_serves_until_signalled(fake, tmp_path, sig):
    port = _free_port_pair()
    urls_file = tmp_path / "urls.txt"
    cmd = [
        sys.executable, "-m", "coordrl.cli", "serve-readers", "--model", "/m", "--cpu",
        "--python", str(fake), "--port-base", str(port), "--urls-file", str(urls_file), "--log-dir", str(tmp_path),
        "--", "--seed", "7",
    ]  # fmt: skip
    # Ctrl-C must reach the CLI even when this test process ignores SIGINT (an ignored signal stays
    # ignored across exec; a shell's background job, e.g. `./scripts/test.sh &`, starts that way).
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=restore_sigint)
    try:
        deadline = time.monotonic() + 60
        while not urls_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert urls_file.read_text() == f"http://127.0.0.1:{port}\n"
        record = _record(tmp_path, port)
        assert record["argv"][-2:] == ["--seed", "7"]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.strip() == f"http://127.0.0.1:{port}"
    assert not urls_file.exists()
    assert _wait_dead(record["pid"]) and _wait_dead(record["child"])


def test_cli_reports_a_failed_start(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "die")
    cmd = [sys.executable, "-m", "coordrl.cli", "serve-readers", "--model", "/m", "--gpus", "0",
           "--python", str(fake), "--port-base", str(_free_port_pair()), "--log-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "gpu0" in done.stderr and "boom" in done.stderr
