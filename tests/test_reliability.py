"""Run folders are owned, user mistakes are one-line errors, reader timeouts are the user's, traces stay clean."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_injecting_server import FaultInjectingFakeServer

from coordrl.cli import main
from coordrl.rundir import (
    LOCK_NAME,
    RunDirError,
    RunLock,
    ensure_writable_dir,
    rewrite_jsonl,
    truncate_torn_tail,
)
from coordrl.train.config import ConfigError, load_config
from coordrl.train.plan import format_plan, make_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
QUIET = ["--eval_strategy", "no", "--eval_data", "null", "--report_to", "none"]
HOLD_LOCK = "import sys, time; from coordrl.rundir import RunLock; RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)"


@pytest.fixture
def read_only(tmp_path):
    """A folder on a read-only filesystem (a real ``ro`` tmpfs where this process may mount one)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)  # not root: permissions bind
        yield ro
        ro.chmod(0o755)
        return
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
        check=False,
        capture_output=True,
    ).returncode:
        pytest.skip("root without permission to mount a read-only tmpfs: nothing here is unwritable")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=False)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    assert (
        main(
            [
                "data",
                "build",
                "--out",
                str(out),
                "--num-paragraphs",
                "20",
                "--num-samples",
                "2",
            ]
        )
        == 0
    )
    return out


# -- the lock -------------------------------------------------------------------------------------


def test_lock_is_exclusive_across_processes_and_freed_when_its_holder_dies(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        record = json.loads((folder / LOCK_NAME).read_text())
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
        with pytest.raises(RunDirError, match=rf"in use by pid {holder.pid} on host"):
            RunLock(folder).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 drops the OS lock: the record it left is stale and taken over (and reported).
    with RunLock(folder) as lock:
        assert lock.previous is not None and lock.previous.pid == holder.pid
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert (folder / LOCK_NAME).read_text() == ""  # a clean release leaves no holder
    with RunLock(folder) as lock:
        assert lock.previous is None


def test_lock_left_on_another_host_needs_break_lock(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(
        json.dumps({"pid": 1, "host": "elsewhere", "started": "x", "command": "coordrl train"})
    )
    with pytest.raises(RunDirError, match="--break-lock"):
        RunLock(folder).acquire()
    assert "elsewhere" in (folder / LOCK_NAME).read_text()  # the refused run did not wipe the record
    with RunLock(folder, break_lock=True) as lock:
        assert lock.previous.host == "elsewhere"


def test_lock_record_hides_secret_looking_values(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "coordrl",
            "train",
            "--hub_token",
            "hf_SECRET",
            "--api-key=sk-SECRET",
            "--max_steps",
            "2",
        ],
    )
    with RunLock(tmp_path / "run"):
        text = (tmp_path / "run" / LOCK_NAME).read_text()
    assert "SECRET" not in text and "--max_steps 2" in text


def test_two_train_processes_into_one_folder(tmp_path):
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "coordrl.cli",
        "train",
        "--config",
        str(TINY),
        "--output_dir",
        str(run),
        "--max_steps",
        "1",
        *QUIET,
    ]
    first = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while not (run / LOCK_NAME).exists() or not (run / LOCK_NAME).read_text().strip():
            assert first.poll() is None and time.time() < deadline, "the first run never took its lock"
            time.sleep(0.1)
        second = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        err = second.stderr.strip().splitlines()[-1]
        assert err.startswith("coordrl: error: output_dir") and f"in use by pid {first.pid}" in err
        assert "Traceback" not in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


# -- one-line errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            ["--eval_strategy", "steps", "--eval_data", "null"],
            "eval_strategy: 'steps' needs eval_data",
        ),
        (["--per_device_train_batch_size", "3"], "per_device_train_batch_size 3"),
        (["--model", "/nonexistent/model"], "model: no such folder /nonexistent/model"),
        (
            ["--model", "coordrl-no-such-org/no-such-model"],
            "model: 'coordrl-no-such-org/no-such-model' is not a local folder",
        ),
        (["--readers", "http://127.0.0.1:9"], "reader_model: required"),
        (["--reader_timeout_s", "0"], "reader_timeout_s: must be > 0"),
    ],
)
def test_train_config_mistakes_are_one_line_errors(tmp_path, capsys, overrides, names):
    base = [
        "train",
        "--config",
        str(TINY),
        "--output_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "1",
        "--report_to",
        "none",
    ]
    if "eval_strategy" not in overrides:
        base += ["--eval_strategy", "no", "--eval_data", "null"]
    assert main([*base, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("coordrl: error: ") and names in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_plan_batch_check_runs_before_trl():
    with pytest.raises(ConfigError, match=r"generation_batch_size \(3 = per_device_train_batch_size 3"):
        from coordrl.train.plan import check_batch

        check_batch(load_config(TINY, {"per_device_train_batch_size": "3"}))


def test_unwritable_outputs_are_one_line_errors(read_only, dataset, capsys):
    commands = [
        [
            "data",
            "build",
            "--out",
            str(read_only / "ds"),
            "--num-paragraphs",
            "20",
            "--num-samples",
            "1",
        ],
        [
            "train",
            "--config",
            str(TINY),
            "--output_dir",
            str(read_only / "run"),
            *QUIET,
        ],
        [
            "eval",
            "--policy",
            "scripted",
            "--data",
            str(dataset),
            "--out",
            str(read_only / "eval"),
            "--no-progress",
        ],
    ]
    for args in commands:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            err[-1].startswith("coordrl: error: ") and str(read_only) in err[-1] and "cannot be written" in err[-1]
        ), err
    with pytest.raises(RunDirError, match="cannot be written"):
        ensure_writable_dir(read_only / "x", "--out")


# -- reader timeouts -------------------------------------------------------------------------------


def test_plan_prints_the_worst_case_reader_round():
    default = make_plan(
        load_config(TINY, {"readers": "http://127.0.0.1:9", "reader_model": "m"}),
        check=False,
    )
    assert default.reader_round.worst_case_s == pytest.approx(60 * 4 + 0.5 * 7)  # 243.5 s
    short = make_plan(
        load_config(
            TINY,
            {
                "readers": "http://127.0.0.1:9",
                "reader_model": "m",
                "reader_timeout_s": "2",
                "reader_retries": "2",
            },
        ),
        check=False,
    )
    assert short.reader_round.worst_case_s == pytest.approx(2 * 3 + 0.5 * 3)
    assert "2 x (2+1) + 0.5 x (2^2 - 1) = 7.5 s per round" in format_plan(short)
    assert "no network timeouts" in format_plan(make_plan(load_config(TINY), check=False))


def test_hung_reader_costs_what_the_user_set(dataset, tmp_path, capsys):
    with FaultInjectingFakeServer(hang_s=60.0) as server:
        server.fault_always = "hang"
        flags = [
            "--readers",
            server.url,
            "--reader-model",
            "m",
            "--reader-timeout",
            "0.5",
            "--reader-retries",
            "0",
        ]
        t0 = time.perf_counter()
        assert (
            main(
                [
                    "rollout",
                    "--data",
                    str(dataset),
                    "--max-turns",
                    "1",
                    "--json",
                    *flags,
                ]
            )
            == 0
        )
        rollout_s = time.perf_counter() - t0
        episode = json.loads(capsys.readouterr().out)
        assert episode["info"]["reader_errors"] == episode["info"]["reader_calls"] > 0
        t0 = time.perf_counter()
        out = tmp_path / "eval"
        assert (
            main(
                [
                    "eval",
                    "--policy",
                    "scripted",
                    "--data",
                    str(dataset),
                    "--out",
                    str(out),
                    "--limit",
                    "1",
                    "--max-turns",
                    "1",
                    "--no-progress",
                    *flags,
                ]
            )
            == 0
        )
        eval_s = time.perf_counter() - t0
        capsys.readouterr()
        results = json.loads((out / "results.json").read_text())
        assert results["env"]["reader_timeout_s"] == 0.5 and results["env"]["reader_retries"] == 0
        assert results["overall"]["reader_errors"] > 0
        document = tmp_path / "doc.txt"
        document.write_text("Paris is the capital of France. " * 50)
        question = ["--question", "What is the capital of France?"]
        t0 = time.perf_counter()
        main(
            [
                "answer",
                "--policy",
                "scripted",
                "--document",
                str(document),
                *question,
                "--max-turns",
                "1",
                "--json",
                *flags,
            ]
        )
        answer_s = time.perf_counter() - t0
        assert json.loads(capsys.readouterr().out)["info"]["reader_errors"] > 0
    # The defaults (60 s x 4 attempts) would take minutes; the bound is generous for a loaded machine.
    assert rollout_s < 20 and eval_s < 20 and answer_s < 20, (
        rollout_s,
        eval_s,
        answer_s,
    )


# -- trace files -----------------------------------------------------------------------------------


def test_eval_rerun_cuts_a_torn_trace_line(dataset, tmp_path):
    out = tmp_path / "eval"
    args = [
        "eval",
        "--policy",
        "scripted",
        "--data",
        str(dataset),
        "--out",
        str(out),
        "--no-progress",
        "--max-turns",
        "1",
    ]
    assert main([*args, "--limit", "1"]) == 0
    trace = next((out / "traces").glob("*.jsonl"))
    with open(trace, "a", encoding="utf-8") as fh:
        fh.write('{"id": "torn", "status": "o')  # a kill mid-write
    assert main(args) == 0
    lines = trace.read_text().splitlines()
    assert [json.loads(line)["status"] for line in lines] == [
        "ok",
        "ok",
    ]  # every line parses; no torn record


def test_trace_file_helpers(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 2, "x"')
    assert truncate_torn_tail(path) == len('{"step": 2, "x"')
    assert truncate_torn_tail(path) == 0 and path.read_text().endswith("}\n")
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')
    assert rewrite_jsonl(path, lambda r: r["step"] < 2) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [
        0,
        1,
    ]
    assert rewrite_jsonl(tmp_path / "missing.jsonl", lambda r: True) == 0


def test_eval_and_index_refuse_a_folder_in_use(dataset, tmp_path, capsys):
    for folder, args in (
        (
            tmp_path / "eval",
            [
                "eval",
                "--policy",
                "scripted",
                "--data",
                str(dataset),
                "--out",
                str(tmp_path / "eval"),
            ],
        ),
        (
            tmp_path / "cache",
            ["index", "--data", str(dataset), "--cache", str(tmp_path / "cache")],
        ),
    ):
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(folder)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout.readline().strip() == "locked"
            assert main([*args, "--no-progress"] if args[0] == "eval" else args) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert f"in use by pid {holder.pid}" in err[-1] and len(err) == 1, err
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
