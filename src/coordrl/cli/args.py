"""argparse value types, flags and setting parsers shared by `coordrl` subcommands (each flag declared once)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from coordrl.readers.routing import ACTIVATIONS


def _checked(text: str, cast: type, ok, kind: str, want: str):
    """``cast(text)`` when ``ok`` holds for it; else an argparse error naming the bad value."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1, or an argparse error naming the bad value."""
    return _checked(text, int, lambda v: v >= 1, "an integer", "a positive integer")


def positive_float(text: str) -> float:
    """A number > 0 (seconds), or an argparse error naming the bad value."""
    return _checked(text, float, lambda v: v > 0, "a number of seconds", "a positive number of seconds")


def non_negative_int(text: str) -> int:
    """An integer >= 0, or an argparse error naming the bad value."""
    return _checked(text, int, lambda v: v >= 0, "an integer", "an integer >= 0")


def add_reader_limit_flags(p: argparse.ArgumentParser) -> None:
    """``--reader-timeout`` / ``--reader-retries`` (see :func:`add_reader_flags`): the worst case of one
    tool round against hung readers is timeout x (retries + 1) plus the fleet's backoff between attempts."""
    p.add_argument("--reader-timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="per-attempt limit of one reader request (default: the policy's recorded setting, else 60)")  # fmt: skip
    p.add_argument("--reader-retries", type=non_negative_int, default=None, metavar="N",
                   help="retries of a reader request that timed out or failed (default: recorded setting, else 3)")  # fmt: skip


def add_reader_flags(p: argparse.ArgumentParser) -> None:
    """The readers of ``rollout``, ``eval`` and ``answer``: ``--readers``, ``--reader-model`` and the
    limits of :func:`add_reader_limit_flags`."""
    p.add_argument("--readers", default="lexical", help="'lexical' (default) or comma-separated reader server URLs")
    p.add_argument("--reader-model", default=None, help="model name served at the reader URLs")
    add_reader_limit_flags(p)


def add_chunk_overlap_flag(p: argparse.ArgumentParser) -> None:
    """``--chunk-overlap-tokens`` of ``rollout``, ``eval`` and ``answer`` (PARSER reader chunks)."""
    p.add_argument("--chunk-overlap-tokens", type=non_negative_int, default=None, metavar="N",
                   help="tokens each reader chunk shares with the next, below --chunk-tokens "
                   "(default: the policy's recorded setting, else 0: chunks tile the document)")  # fmt: skip


def add_activation_flag(p: argparse.ArgumentParser) -> None:
    """``--activation`` of ``rollout``, ``eval`` and ``answer``: which PARSER chunk readers a query wakes,
    so a policy trained with one activation can be evaluated or run with the other."""
    p.add_argument("--activation", choices=ACTIVATIONS, default=None,
                   help="PARSER readers a query wakes: 'all' (every chunk reader) or 'routed' (the chunks the routing "
                   "pathways propose, with the policy's recorded route_* settings, else BM25 and summary top-8) "
                   "(default: the policy's recorded setting, else all)")  # fmt: skip


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """``--temperature`` and ``--seed`` of ``rollout`` and ``eval``: how the policy samples its turns."""
    p.add_argument("--temperature", type=float, default=0.0, help="policy sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="policy sampling seed (default 0)")


def add_break_lock_flag(p: argparse.ArgumentParser, locked: str) -> None:
    """``--break-lock`` of the commands that hold a lock on their output folder ``locked`` while they
    run (`coordrl.rundir.RunLock`): a lock left by a run on another host is never taken over silently."""
    p.add_argument("--break-lock", action="store_true", help=f"take over {locked}'s lock left by a run on another host")


def add_parser_env_flags(p: argparse.ArgumentParser) -> None:
    """The PARSER environment flags ``rollout``, ``eval`` and ``answer`` share: ``--chunk-overlap-tokens``,
    ``--activation`` and the reader flags of :func:`add_reader_flags`."""
    add_chunk_overlap_flag(p)
    add_activation_flag(p)
    add_reader_flags(p)


def add_episode_flags(
    p: argparse.ArgumentParser,
    policy: dict[str, Any],
    *,
    max_turns: int | None = None,
    chunk_tokens: int | None = None,
    max_turns_help: str = "tool rounds per episode (default 12, PARSER's evaluation cap)",
    chunk_tokens_help: str = "tokens per reader chunk (default 4096)",
) -> None:
    """What one episode of ``rollout``, ``eval`` and ``answer`` plays: ``--policy`` (``policy``: its
    argparse keywords, e.g. ``required=True`` or a default and help), ``--max-turns`` and
    ``--chunk-tokens`` (None: the policy's evaluation setting is applied later)."""
    p.add_argument("--policy", **policy)
    p.add_argument("--max-turns", type=positive_int, default=max_turns, help=max_turns_help)
    p.add_argument("--chunk-tokens", type=positive_int, default=chunk_tokens, help=chunk_tokens_help)


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    """Where the policy of ``eval`` and ``answer`` runs: ``--policy-url`` (an OpenAI-compatible server,
    e.g. ``vllm serve EXPORT``) with ``--served-model``, else in-process on ``--device``; and its
    ``--max-new-tokens`` per turn and ``--hmars`` setting overrides."""
    p.add_argument("--policy-url", default=None,
                   help="OpenAI-compatible server serving the policy (e.g. vllm serve EXPORT); default: in-process transformers")  # fmt: skip
    p.add_argument("--served-model", default=None,
                   help="model name at --policy-url (default: the first listed by /v1/models)")  # fmt: skip
    p.add_argument("--device", default=None, help="in-process device (default: cuda if available, else cpu)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens per policy turn (default: training's cap, else 512)")  # fmt: skip
    p.add_argument("--hmars", action="append", default=None, metavar="KEY=VALUE",
                   help="hmars policies: replace a recorded HmarsEnvConfig setting (repeatable), "
                   "e.g. c_sub=4096 selector=URL mode=no_mid")  # fmt: skip


def reader_limits(args: Any) -> dict[str, float | int]:
    """The ``ParserEnvConfig`` fields the reader flags set (only the flags given)."""
    out: dict[str, float | int] = {}
    if getattr(args, "reader_timeout", None) is not None:
        out["reader_timeout_s"] = args.reader_timeout
    if getattr(args, "reader_retries", None) is not None:
        out["reader_retries"] = args.reader_retries
    return out


class UsageError(ValueError):
    """A flag combination that cannot work; reported like a data error."""


def parse_settings(items: Sequence[str] | None) -> dict[str, Any] | None:
    """``KEY=VALUE`` pairs (``--hmars``) as a dict; values are read as YAML scalars (``4096`` -> int,
    ``true`` -> bool, ``http://...`` -> str). None when there are none."""
    import yaml

    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--hmars {item!r}: expected KEY=VALUE, e.g. c_sub=4096 or selector=http://host:8001/v1")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = value
    return out
