"""What a policy spec names, and how it loads: shared by evaluation, export and inference.

`resolve_policy` reads any policy spec (``scripted``, a checkpoint, an export, a plain model folder or
a hub id) into a `PolicySource`: the prompt, protocol and environment settings the policy was trained
with. `load_policy` turns a `PolicySource` into ``(policy, tokenizer)``: in-process transformers
(`HFPolicy`) or an OpenAI-compatible server (`OpenAIPolicy`). Weights are safetensors only.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordrl.data.errors import DataError
from coordrl.data.tokens import load_tokenizer
from coordrl.envs.parser import ParserEnvConfig
from coordrl.envs.prompts import LEAD_SYSTEM_PROMPT
from coordrl.envs.protocols import PROTOCOLS, get_protocol
from coordrl.rollout.models import (
    CHECKPOINT_META,
    COMPLETE_MARKER,
    TINY_MODEL,
    latest_complete_checkpoint,
    resolve_model,
)
from coordrl.rollout.openai_policy import OpenAIPolicy
from coordrl.rollout.policies import HFPolicy, ScriptedLead

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "POLICY_META",
    "PolicyError",
    "PolicySource",
    "SerialPolicy",
    "check_checkpoint",
    "generation_from_config",
    "is_hub_id",
    "load_policy",
    "model_weights",
    "read_json",
    "resolve_policy",
]

POLICY_META = "coordrl_policy.json"
# Per-turn generation cap for policies that recorded none (plain models, hub ids).
DEFAULT_MAX_NEW_TOKENS = 512
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_PICKLE_WEIGHT_PATTERNS = (
    "pytorch_model*.bin",
    "adapter_model.bin",
    "model*.pt",
    "model*.pth",
    "consolidated*.pth",
    "*.ckpt",
)


class PolicyError(DataError):
    """A policy, checkpoint or export that cannot be used as given; the message names the problem."""


@dataclass
class PolicySource:
    """Everything needed to run a policy the way it was trained.

    Attributes:
        spec: the policy as given (folder, hub id or ``scripted``).
        kind: ``scripted`` | ``checkpoint`` | ``export`` | ``model`` (a model folder or hub id
            without coordrl metadata: the default lead prompt and environment settings apply).
        path: where weights and tokenizer load from (None for ``scripted``).
        protocol: coordinator protocol (``parser`` lead agent or ``hmars`` mid-agent).
        system_prompt: the policy's system prompt recorded at training (default: coordrl's).
        answer_format: e.g. ``<answer>...</answer>``.
        env: `ParserEnvConfig` (``parser``) or `HmarsEnvConfig` (``hmars``) fields recorded at
            training (defaults for plain models).
        base_model: the model training started from (None when unknown).
        generation: training's per-turn generation caps (``max_new_tokens``,
            ``max_completion_length``) when recorded.
        meta: the raw ``coordrl_train.json`` / ``coordrl_policy.json``.
    """

    spec: str
    kind: str
    path: str | None
    protocol: str = "parser"
    system_prompt: str = ""
    answer_format: str = "<answer>...</answer>"
    env: dict[str, Any] = field(default_factory=dict)
    base_model: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """A short name for tables and plots: the folder name (``run/final`` -> ``run/final``)."""
        if self.kind == "scripted" or self.path is None:
            return "scripted"
        p = Path(self.path)
        if self.kind == "checkpoint" or p.name in ("final",) or p.name.startswith("checkpoint-"):
            return f"{p.parent.name}/{p.name}"
        return p.name if p.exists() else self.spec

    @property
    def train_max_turns(self) -> int | None:
        """The tool-round cap training used (``max_turns`` of the recorded config), when known."""
        value = (self.meta.get("config") or {}).get("max_turns") or (self.meta.get("turn_caps") or {}).get(
            "train_max_turns"
        )
        return int(value) if value else None

    def eval_max_turns(self, max_turns: int | None = None) -> int:
        """Tool rounds for evaluation and inference: ``max_turns`` when given; else PARSER's
        evaluation cap (12) for ``parser``, and training's cap for ``hmars`` (its mid-agent
        broadcasts once; extra rounds would only allow retries training never allowed)."""
        return get_protocol(self.protocol).eval_max_turns(max_turns, self.train_max_turns)

    def env_config(
        self,
        *,
        readers: str | None = None,
        reader_model: str | None = None,
        max_turns: int | None = None,
        chunk_tokens: int | None = None,
        hmars: dict[str, Any] | None = None,
        chunk_overlap_tokens: int | None = None,
        activation: str | None = None,
    ):
        """The environment settings for evaluation or inference.

        ``parser``: a `ParserEnvConfig`. Reader, observation and query settings come from training;
        ``readers`` / ``reader_model`` replace the training readers when given; ``max_turns``
        (default 12) and ``chunk_tokens`` (default 4096) are the evaluation settings PARSER uses,
        not the training ones; ``chunk_overlap_tokens`` replaces training's chunk overlap and
        ``activation`` (``all`` / ``routed``) training's reader activation when given.

        ``hmars``: the `HmarsEnvConfig` recorded at training (regions, pages, frozen roles, mode),
        with ``hmars`` (field -> value, e.g. ``{"c_sub": 4096, "selector": "http://..."}``)
        applied on top; the PARSER reader arguments do not apply and are refused when set.
        """
        protocol = get_protocol(self.protocol)
        if hmars and not protocol.settings_block:
            raise PolicyError(
                f"{self.spec} is a {self.protocol} policy; HMARS settings ({', '.join(hmars)}) do not apply"
            )
        try:
            overrides = protocol.eval_settings(
                readers, reader_model, max_turns, chunk_tokens, chunk_overlap_tokens, activation
            )
            # Chunks, regions, pages and budgets count the policy's own tokenizer's tokens.
            return protocol.config(self.env, **{**overrides, **(hmars or {}), "tokenizer": self.path})
        except ValueError as e:
            raise PolicyError(f"{self.spec} is a {self.protocol} policy: {e}") from None

    def prompt(self, question: str) -> list[dict[str, str]]:
        """The ``[system, user]`` conversation an episode starts from (the protocol's prompt)."""
        return get_protocol(self.protocol).prompt(question, self.system_prompt)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PolicyError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{path}: expected a JSON object")
    return data


def _check_protocol(where: Path, protocol: Any) -> str:
    if protocol not in PROTOCOLS:
        raise PolicyError(
            f"{where} was trained for protocol {protocol!r}; coordrl eval/export/answer support {', '.join(PROTOCOLS)} only"
        )
    return str(protocol)


def model_weights(folder: str | Path) -> tuple[str, list[Path]]:
    """``(kind, files)`` of a folder's weights: ``full`` (safetensors, one file or shards with their
    index) or ``adapter`` (``adapter_model.safetensors``). Raises `PolicyError` for pickled weights
    (``.bin`` / ``.pt``), missing shards or no weights at all."""
    folder = Path(folder)
    if (folder / "adapter_config.json").exists():
        adapter = folder / "adapter_model.safetensors"
        if adapter.exists():
            return "adapter", [adapter]
        if (folder / "adapter_model.bin").exists():
            raise PolicyError(
                f"{folder}: the LoRA adapter is a pickle file (adapter_model.bin); coordrl accepts safetensors only"
            )
        raise PolicyError(f"{folder}: adapter_config.json but no adapter_model.safetensors (incomplete checkpoint)")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map") or {}
        shards = sorted({folder / name for name in weight_map.values()})
        missing = [p.name for p in shards if not p.exists()]
        if not shards or missing:
            raise PolicyError(
                f"{folder}: incomplete checkpoint: weight shards missing ({', '.join(missing) or 'empty index'})"
            )
        return "full", [index, *shards]
    single = folder / "model.safetensors"
    if single.exists():
        return "full", [single]
    pickles = sorted({p.name for pattern in _PICKLE_WEIGHT_PATTERNS for p in folder.glob(pattern)})
    if pickles:
        raise PolicyError(
            f"{folder}: the weights are pickle files ({', '.join(pickles)}); coordrl loads and exports safetensors only "
            "(load them yourself and re-save with save_pretrained(..., safe_serialization=True))"
        )
    raise PolicyError(f"{folder}: incomplete checkpoint: no model weights (model.safetensors)")


def check_checkpoint(folder: str | Path) -> dict[str, Any]:
    """Validate a training checkpoint and return its ``coordrl_train.json``.

    A checkpoint is complete when it holds ``coordrl_train.json``, the ``COMPLETE`` marker (written
    last by training), ``config.json`` and safetensors weights, and was trained for a supported
    protocol. Anything else raises `PolicyError` naming the problem.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise PolicyError(f"checkpoint {folder} does not exist or is not a folder")
    if not (folder / CHECKPOINT_META).exists():
        if (folder / POLICY_META).exists():
            raise PolicyError(f"{folder} is already an export ({POLICY_META}), not a training checkpoint")
        _training_dir_hint(folder)
        raise PolicyError(f"{folder} is not a coordrl checkpoint: {CHECKPOINT_META} is missing")
    if not (folder / COMPLETE_MARKER).exists():
        raise PolicyError(
            f"{folder} is an incomplete checkpoint: the {COMPLETE_MARKER} marker is missing "
            "(the save was interrupted or is still running); use another checkpoint"
        )
    meta = read_json(folder / CHECKPOINT_META)
    _check_protocol(folder, meta.get("protocol"))
    if not (folder / "config.json").exists():
        raise PolicyError(f"{folder}: incomplete checkpoint: config.json is missing")
    model_weights(folder)
    return meta


def _training_dir_hint(folder: Path) -> None:
    if (folder / "final" / COMPLETE_MARKER).exists() or latest_complete_checkpoint(folder) is not None:
        best = folder / "final" if (folder / "final" / COMPLETE_MARKER).exists() else latest_complete_checkpoint(folder)
        raise PolicyError(f"{folder} is a training output folder; pass one of its checkpoints, e.g. {best}")


def generation_from_config(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gen = config.get("generation_kwargs") or {}
    if isinstance(gen, dict) and gen.get("max_new_tokens"):
        out["max_new_tokens"] = int(gen["max_new_tokens"])
    if config.get("max_completion_length"):
        out["max_completion_length"] = int(config["max_completion_length"])
    return out


def resolve_policy(spec: str | os.PathLike[str]) -> PolicySource:
    """Read a policy spec.

    Args:
        spec: ``scripted``; ``coordrl:tiny-qwen3``; a checkpoint folder (``coordrl_train.json``,
            checked with `check_checkpoint`); an export (``coordrl_policy.json``); a plain model folder
            (``config.json``); or a hub id (``org/name``, loaded from the local cache when offline).
    """
    text = str(spec)
    if text == "scripted":
        return PolicySource(text, "scripted", None, system_prompt=LEAD_SYSTEM_PROMPT, env=ParserEnvConfig().to_dict())
    if text == TINY_MODEL:
        return PolicySource(
            text,
            "model",
            resolve_model(text),
            system_prompt=LEAD_SYSTEM_PROMPT,
            env=ParserEnvConfig().to_dict(),
            base_model=text,
        )
    path = Path(text)
    if path.is_dir():
        if (path / POLICY_META).exists():
            meta = read_json(path / POLICY_META)
            protocol = _check_protocol(path, meta.get("protocol"))
            if not (path / "config.json").exists():
                raise PolicyError(f"{path}: incomplete export: config.json is missing")
            model_weights(path)
            return PolicySource(
                text,
                "export",
                str(path),
                protocol=protocol,
                system_prompt=meta.get("system_prompt") or get_protocol(protocol).system_prompt,
                answer_format=meta.get("answer_format") or "<answer>...</answer>",
                env=dict(meta.get("env") or {}),
                base_model=meta.get("base_model"),
                generation=dict(meta.get("generation") or {}),
                meta=meta,
            )
        if (path / CHECKPOINT_META).exists():
            meta = check_checkpoint(path)
            return PolicySource(
                text,
                "checkpoint",
                str(path),
                protocol=str(meta["protocol"]),
                system_prompt=meta.get("system_prompt") or get_protocol(meta["protocol"]).system_prompt,
                answer_format=meta.get("answer_format") or "<answer>...</answer>",
                env=dict(meta.get("env") or {}),
                base_model=meta.get("base_model"),
                generation=generation_from_config(meta.get("config") or {}),
                meta=meta,
            )
        _training_dir_hint(path)
        if not (path / "config.json").exists():
            raise PolicyError(f"{path} is not a model folder (no config.json, {POLICY_META} or {CHECKPOINT_META})")
        model_weights(path)
        return PolicySource(
            text, "model", str(path), system_prompt=LEAD_SYSTEM_PROMPT, env=ParserEnvConfig().to_dict(), base_model=text
        )
    if path.exists():
        raise PolicyError(f"policy {text} is a file; pass a model folder, a hub id or 'scripted'")
    if not is_hub_id(text):
        raise PolicyError(f"policy {text}: no such folder (and not a hub id of the form org/name)")
    # A hub id: transformers resolves it (from the local cache when HF_HUB_OFFLINE=1).
    return PolicySource(
        text, "model", text, system_prompt=LEAD_SYSTEM_PROMPT, env=ParserEnvConfig().to_dict(), base_model=text
    )


def is_hub_id(name: str | None) -> bool:
    """True for ``org/name`` (a Hugging Face hub id), not for a bare name or a path."""
    return bool(name) and _HUB_ID.fullmatch(str(name)) is not None


class SerialPolicy:
    """Lets one in-process model serve many threads: generation is serialised behind a lock
    (a CPU/GPU forward pass gains nothing from interleaving), while readers of other episodes keep
    running concurrently."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.name = getattr(policy, "name", type(policy).__name__)
        self._lock = threading.Lock()

    def act(self, env):
        with self._lock:
            return self.policy.act(env)


def load_policy(
    source: PolicySource,
    *,
    policy_url: str | None = None,
    served_model: str | None = None,
    device: str | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    weights: str | None = None,
    timeout_s: float = 300.0,
    max_retries: int = 2,
):
    """``(policy, tokenizer)`` for a resolved policy.

    Args:
        source: from `resolve_policy`.
        policy_url: an OpenAI-compatible server serving the policy (`OpenAIPolicy`); None (default):
            transformers in-process (`HFPolicy`, serialised with `SerialPolicy`).
        served_model: the model name on that server (default: the first one ``/v1/models`` lists).
        device: in-process device (default: cuda when available, else cpu).
        max_new_tokens: tokens per assistant turn (default: training's per-turn cap when recorded,
            else 512).
        temperature: 0 (default) decodes greedily.
        seed: sampling seed.
        weights: load weights and tokenizer from here instead of ``source.path`` (the ``prompted``
            baseline: the base model with the trained policy's prompt and settings).
        timeout_s / max_retries: per-request limits of the server policy (default 300 s, 2 retries).
    """
    if source.kind == "scripted":
        return ScriptedLead(), load_tokenizer(None)
    path = weights or source.path
    assert path is not None
    budget = max_new_tokens or source.generation.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    try:
        if policy_url:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            policy = OpenAIPolicy(
                policy_url, served_model, tokenizer, max_new_tokens=budget, temperature=temperature,
                seed=seed, timeout_s=timeout_s, max_retries=max_retries,
            )  # fmt: skip
            return policy, tokenizer
        policy = HFPolicy(path, max_new_tokens=budget, temperature=temperature, seed=seed, device=device)
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise PolicyError(
            f"cannot load policy {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    return SerialPolicy(policy), policy.tokenizer
