"""Output folders a command owns: an exclusive lock for the run's life, writability checks, clean JSONL.

``coordrl train``, ``eval`` and ``index`` hold `RunLock` on their output folder while they run, so two
runs never interleave their traces or checkpoints in one folder. The lock is an OS lock
(``fcntl.flock``) on ``<folder>/.coordrl.lock``; the file also records the holder (pid, host, start time,
command line with secret-looking values hidden) so a refused run can name it.

Stale locks: the OS drops a ``flock`` when its process dies, however it dies (kill -9 included), so a
lock file that still names a holder while its lock is free was left by a process that is gone. On the
same host that is certain: the lock is taken over and the previous holder reported on stderr. A holder
on another host (a shared network filesystem, where ``flock`` may not reach across machines) cannot be
checked from here: the run is refused unless ``--break-lock`` is given.

`filelock` (a dependency of huggingface-hub) is not used: it records nothing about the holder, and its
soft-lock fallback would let two processes on a filesystem without ``flock`` both proceed.

Also here: `ensure_writable_dir` (a one-line error naming an output folder that cannot be written) and
`truncate_torn_tail` / `rewrite_jsonl` for the append-only JSONL trace files a crash can leave with a
half-written last line. Nothing in this module imports from coordrl's higher layers.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from coordrl.data.errors import DataError

__all__ = [
    "LOCK_NAME",
    "LockHolder",
    "RunDirError",
    "RunLock",
    "ensure_writable_dir",
    "rewrite_jsonl",
    "truncate_torn_tail",
]

LOCK_NAME = ".coordrl.lock"
# Command-line values that may be credentials (``--hub_token X``, ``--api-key=X``) are not recorded.
_SECRET_FLAG = re.compile(r"token|key|secret|passw", re.IGNORECASE)


class RunDirError(DataError):
    """An output folder that cannot be used (locked, unwritable, holding another run); names the folder.

    A `DataError`, so the CLI reports it as one line with exit status 2.
    """


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a run folder: process id, host name, start time (UTC, ISO 8601), command."""

    pid: int
    host: str
    started: str
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} since {self.started} ({self.command})"

    @classmethod
    def current(cls) -> LockHolder:
        return cls(
            os.getpid(),
            socket.gethostname(),
            datetime.now(UTC).isoformat(timespec="seconds"),
            _redacted_command(sys.argv),
        )


def _redacted_command(argv: Sequence[str]) -> str:
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        if arg.startswith("-") and _SECRET_FLAG.search(arg):
            if "=" in arg:
                arg = arg.split("=", 1)[0] + "=***"
            else:
                hide_next = True
        out.append(arg)
    text = " ".join([Path(out[0]).name, *out[1:]]) if out else "python"
    return text[:300]


def _read_holder(fd: int) -> LockHolder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return None
    try:
        data = json.loads(raw)
        return LockHolder(
            int(data["pid"]),
            str(data["host"]),
            str(data["started"]),
            str(data.get("command", "")),
        )
    except (ValueError, KeyError, TypeError):
        return LockHolder(-1, "unknown", "unknown", "unreadable lock file")


class RunLock:
    """Exclusive ownership of ``folder`` (created if missing) until `release` or process exit.

    Args:
        folder: the output folder.
        what: the flag or field naming the folder in messages (default ``"output folder"``), e.g.
            ``"--out"`` or ``"output_dir"``.
        break_lock: take over a lock left by a holder on another host (default False: refuse).

    Use as a context manager, or `acquire` / `release`. ``previous`` is the stale holder taken over,
    if any. Raises `RunDirError` when another live process holds the folder, or it cannot be written.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        what: str = "output folder",
        break_lock: bool = False,
    ) -> None:
        self.folder = Path(folder)
        self.what = what
        self.break_lock = break_lock
        self.path = self.folder / LOCK_NAME
        self.previous: LockHolder | None = None
        self._fd: int | None = None

    def acquire(self) -> Self:
        ensure_writable_dir(self.folder, self.what)
        try:
            # No O_TRUNC: a refused contender must not wipe the holder's record.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"{self.what} {self.folder}: cannot create {LOCK_NAME}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"{self.what} {self.folder}: cannot lock {LOCK_NAME}: {e.strerror}") from None
            who = holder.describe() if holder else "another process"
            raise RunDirError(
                f"{self.what} {self.folder} is in use by {who}; wait for that run to end or choose another folder"
            ) from None
        previous = _read_holder(fd)
        if previous is not None and previous.host != socket.gethostname() and not self.break_lock:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise RunDirError(
                f"{self.what} {self.folder} was locked by {previous.describe()}, which cannot be checked from this "
                "host; if that run is gone pass --break-lock"
            )
        if previous is not None:
            print(
                f"coordrl: taking over the stale lock of {self.folder} left by {previous.describe()} (that process is gone)",
                file=sys.stderr,
            )
        self.previous = previous
        record = json.dumps(asdict(LockHolder.current())).encode() + b"\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the holder record (an empty lock file means a clean release) and drop the lock."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the OS lock is dropped below either way; a leftover record only reads as stale
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def ensure_writable_dir(folder: str | Path, what: str = "output folder") -> Path:
    """Create ``folder`` (and parents) and check a file can be written in it.

    Raises `RunDirError` naming ``what`` and the folder (read-only filesystem, no permission, a file in
    the way, disk full) instead of the traceback the first write deep inside a run would give.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".coordrl-write-check-"):
            pass
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(folder) else ""
        raise RunDirError(
            f"{what} {folder} cannot be written: {e.strerror or e}{where}; choose a writable folder"
        ) from None
    return folder


def truncate_torn_tail(path: str | Path) -> int:
    """Cut a half-written last line (no trailing newline, left by a crash mid-write) off a JSONL file.

    Returns the bytes removed (0 when the file ends cleanly or does not exist).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as fh:
        end = size
        block = 65536
        while end > 0:
            start = max(0, end - block)
            fh.seek(start)
            data = fh.read(end - start)
            if end == size and data.endswith(b"\n"):
                return 0
            cut = data.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                fh.truncate(keep)
                return size - keep
            end = start
        fh.truncate(0)
        return size


def rewrite_jsonl(path: str | Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite a JSONL file with only the records ``keep`` accepts; torn or unparsable lines are dropped.

    The new file replaces the old one atomically (a crash leaves one or the other). Returns the number of
    lines dropped (0 leaves the file untouched).
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept: list[bytes] = []
    dropped = 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                dropped += 1  # torn last line
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if isinstance(record, dict) and keep(record):
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.writelines(kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return dropped
