"""`coordrl train` configuration: one flat YAML of coordrl fields and TRL ``GRPOConfig`` fields.

Flat on purpose: overrides on the command line use the field names exactly as written in the YAML,
TRL style (``--max_steps 2 --output_dir out``). A key that is neither a `CoordConfig` field nor a
``GRPOConfig`` field is an error naming the key (and the closest valid name).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from coordrl.data.errors import ConfigError
from coordrl.envs.parser import ParserEnvConfig
from coordrl.envs.protocols import PROTOCOLS, get_protocol


@dataclass
class CoordConfig(ParserEnvConfig):
    """coordrl's own training fields (everything else in the YAML goes to ``GRPOConfig``).

    Inherits the environment settings of `ParserEnvConfig` (readers, reader_model,
    lexical_threshold, reader_* limits, chunk_tokens, tokenizer, max_queries,
    observation_max_tokens, max_turns), so the YAML names them directly.

    Attributes:
        protocol: coordinator protocol, ``parser`` (PARSER lead agent) or ``hmars``.
        model: policy: a local folder or a hub id (any Hugging Face causal LM with a chat template TRL knows).
        train_data: a dataset folder from ``coordrl data build``, or ``sample`` to build one from the
            shipped HotpotQA sample into ``<output_dir>/data/train`` (with ``sample_num_paragraphs``), or
            ``world`` for the synthetic multi-hop world (`coordrl.data.world`, seeded by ``seed_data``),
            or ``hmars_world`` for its HMARS layout (`coordrl.data.hmars_world`; ``protocol: hmars`` with
            its region and page sizes, pages cut with the policy's tokenizer).
        eval_data (``world``, ``hmars_world``): the world's held-out questions (chains never seen in training).
        world_train_size / world_heldout_size: questions built for ``world`` / ``hmars_world`` data; default 4000 / 200.
        world_docs_per_chunk: whole documents per reader chunk of ``world`` data (default 2); 1 suits
            model-served readers, which cannot tell two facts of one relation in a passage apart.
        world_train_docs: documents per ``world`` training question, one of these lengths drawn per
            question (seeded), padded with unrelated documents, e.g. ``[8, 64, 256]``; None (default):
            each question's own 7. The questions and the held-out split do not change. A policy
            trained at one length meets chunk numbers and reader counts it never saw at another.
            Data built under ``<output_dir>/data`` is reused only when built with the same settings
            (recorded in ``coordrl_build.json``); otherwise it is rebuilt, with a note on stderr.
        max_train_minutes: stop training (and save) after this many minutes of steps; None: no limit.
        eval_data: a dataset folder for TRL's periodic evaluation (``sample``: held-out shipped
            HotpotQA train questions), or None for no evaluation.
        eval_samples: cap on evaluation samples (None: all).
        sample_num_paragraphs: paragraphs per sample when building from the shipped sample.
        max_turns (inherited): tool rounds per rollout; sets TRL's ``max_tool_calling_iterations``.
        tokenizer (inherited): chunking/observation tokenizer; None means the policy's.
        tool_concurrency: run each tool round's calls for all rollouts concurrently (TRL runs them
            one after another); off only for comparison.
        mask_observations: keep tool-response (observation) tokens out of the loss (default True);
            off only as an ablation (the learning check's).
        lockstep: keep all ranks in step through the tool loop (needed with vLLM server mode,
            tensor-parallel colocate or ZeRO-3 generation).
        share_prompt_prefix: score the rollouts of one prompt with the prompt forwarded once, its KV
            cache shared (`coordrl.train.trainer.CoordGRPOTrainer`); log-probs equal TRL's within float
            rounding, so off by default to keep existing runs' numerics. Worth it when prompts are long
            against completions (the HMARS mid-agent's regional memory).
        share_generation_prefix: with transformers generation (no vLLM), forward the prefix every row of a
            generation call shares (system prompt, tool schema) once and start each row from its KV cache
            (`coordrl.train.trainer.CoordGRPOTrainer`); the same tokens as TRL's generation up to float
            rounding, so off by default to keep existing runs' samples.
        traces: write JSONL rollout traces to ``<output_dir>/traces/``.
        model_params: parameter count for ``--dry-run`` when the model's config.json is not local.
        reader_gpus: GPUs dedicated to reader servers (for ``--dry-run`` and ``scripts/launch_grpo.sh``).
        deepspeed_stage: ZeRO stage the launch uses (0 = none), for ``--dry-run``.
        seed_data: seed of an on-the-fly build.
        deepspeed_offload: ZeRO offload (plan and launch): optimizer state and gradient partitions on CPU
            (stage 2 and 3), parameters too (stage 3), like the PARSER setup; default False.
        policy_server_gpus: GPUs per node for TRL's vLLM policy server when ``vllm_mode: server``
            (plan and launch; single node only); default 0.
        hmars: settings of the HMARS mid-agent environment for ``protocol: hmars`` (keys of
            `coordrl.envs.hmars.HmarsEnvConfig`: c_sub, page_tokens, group_size, selector/answerer/writer
            backends, mode, reward terms, index_cache, ...); unknown keys are an error.
        system_prompt: the policy's system prompt; None (default) is coordrl's for the protocol
            (`coordrl.envs.prompts.LEAD_SYSTEM_PROMPT`, or the HMARS mid-agent's). Recorded in checkpoints
            and exports, so evaluation and inference use the same text.
        allow_truncated_rollouts: let ``max_completion_length`` be smaller than ``max_turns`` full rounds
            need at the per-turn cap (the plan then warns instead of refusing); default False.
    """

    protocol: str = "parser"
    model: str = ""
    train_data: str = "sample"
    eval_data: str | None = None
    eval_samples: int | None = None
    sample_num_paragraphs: int = 200
    tool_concurrency: bool = True
    mask_observations: bool = True
    lockstep: bool = True
    share_prompt_prefix: bool = False
    share_generation_prefix: bool = False
    traces: bool = True
    model_params: float | None = None
    reader_gpus: int = 0
    deepspeed_stage: int = 0
    seed_data: int = 0
    deepspeed_offload: bool = False
    policy_server_gpus: int = 0
    allow_truncated_rollouts: bool = False
    hmars: dict | None = None
    world_train_size: int = 4000
    world_heldout_size: int = 200
    world_docs_per_chunk: int = 2
    world_train_docs: list[int] | None = None
    max_train_minutes: float | None = None
    system_prompt: str | None = None


@dataclass
class TrainConfig:
    """A resolved config: coordrl fields, GRPOConfig keyword arguments, and where it came from."""

    coord: CoordConfig
    grpo: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.coord), **self.grpo}

    def env_config(self, tokenizer: str | None = None) -> Any:
        """The environment settings of this run, as the protocol's config class.

        Taken from the top-level fields the class shares with `CoordConfig` (PARSER's are all
        top-level), then the block named after the protocol (``hmars:``). ``tokenizer`` defaults to
        the config's, else the policy's.
        """
        protocol = get_protocol(self.coord.protocol)
        values = {
            f.name: getattr(self.coord, f.name)
            for f in dataclasses.fields(protocol.config_cls)
            if hasattr(self.coord, f.name)
        }
        values["tokenizer"] = self.coord.tokenizer or tokenizer
        values.update(getattr(self.coord, protocol.name, None) or {})
        return protocol.config(values)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A config dataclass's init fields -> their resolved types.

    ``dataclasses.Field.type`` is the annotation as written, a string wherever the defining module uses
    ``from __future__ import annotations`` (this one and `coordrl.envs.parser` do); `typing.get_type_hints`
    resolves each in its own module's namespace, inherited fields included. Cached: the classes do not change.
    """
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def grpo_field_types() -> dict[str, Any]:
    """``GRPOConfig``'s init fields -> their resolved types."""
    from trl import GRPOConfig

    return _field_types(GRPOConfig)


def _base_types(tp: Any) -> list[Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(tp) for t in _base_types(a)]
    return [tp]


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value or command-line string to the field's resolved type; error names the key."""
    options = _base_types(tp)
    if value is None or (isinstance(value, str) and value.lower() in ("null", "~")):
        if type(None) in options or typing.Any in options:
            return None
        raise ConfigError(f"{key}: may not be null")
    errors = []
    for opt in options:
        if opt is type(None):
            continue
        try:
            if opt is bool:
                if isinstance(value, bool):
                    return value
                if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                    return value.lower() in ("true", "1", "yes")
                raise ValueError("not a boolean")
            if opt is int:
                if isinstance(value, bool):
                    raise ValueError("boolean given")
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError("not an integer")
                return int(value)
            if opt is float:
                return float(value)
            if opt is str:
                if isinstance(value, (dict, list)):
                    raise ValueError("not a string")
                return str(value)
            origin = typing.get_origin(opt) or opt
            if origin in (list, dict, tuple) or opt is typing.Any:
                if isinstance(value, str):
                    parsed = yaml.safe_load(value)
                    if isinstance(parsed, (list, dict)) or opt is typing.Any:
                        return parsed
                    if origin is list:
                        return [parsed]
                    raise ValueError("expected a mapping")
                return value
            if isinstance(opt, type) and issubclass(opt, __import__("enum").Enum):
                return opt(value).value if not isinstance(value, opt) else value.value
            return value
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    raise ConfigError(f"{key}: cannot use {value!r} ({'; '.join(errors) or 'wrong type'})")


def _unknown(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r} (neither a coordrl field nor a GRPOConfig field){hint}")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["--max_steps", "2", "--bf16=false"]`` -> ``{"max_steps": "2", "bf16": "false"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"expected --<field> VALUE, got {arg!r}")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"--{key} needs a value")
            value = args[i + 1]
            i += 2
        out[key.replace("-", "_") if key.replace("-", "_") in _all_keys() else key] = value
    return out


def _all_keys() -> set[str]:
    return set(_field_types(CoordConfig)) | set(grpo_field_types())


def _check_readers(coord: CoordConfig) -> None:
    """Reader settings a run would otherwise trip over at its first tool round (or inside TRL)."""
    if coord.reader_timeout_s <= 0:
        raise ConfigError(f"reader_timeout_s: must be > 0 seconds, got {coord.reader_timeout_s}")
    if coord.reader_retries < 0:
        raise ConfigError(f"reader_retries: must be >= 0, got {coord.reader_retries}")
    if not get_protocol(coord.protocol).uses_readers or coord.readers.strip() == "lexical":
        return
    urls = [u.strip() for u in coord.readers.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise ConfigError(f"readers: must be 'lexical' or comma-separated http(s) URLs, got {coord.readers!r}")
    if not coord.reader_model:
        raise ConfigError(
            "reader_model: required when readers are server URLs; set it to the model name the reader servers serve"
        )


def native_bf16(use_cpu: bool) -> bool:
    """Whether the training device computes bf16 in hardware: with ``use_cpu``, a CPU with AVX512-BF16
    or AMX tiles; otherwise a visible CUDA GPU with bf16 support, or True when no GPU is visible (a GPU
    config planned on a CPU host).

    Why it matters on CPU: without those instructions torch emulates bf16 matmuls. Measured on an
    AVX2-only 2-core EPYC: a 2048x256 by 256x512 matmul with its backward 49 ms in fp32, 743 ms under
    bf16 autocast; a world GRPO step 4-14 s in fp32, 45-78 s in bf16. On AVX512-BF16 cores bf16 is
    the faster one (1.42 vs 2.05 s per world step)."""
    import torch

    if use_cpu:
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private in torch.cpu: guarded
        return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def _resolve_bf16(grpo: dict[str, Any]) -> None:
    """``bf16: auto`` -> bf16 exactly where it is native (`native_bf16`); an explicit ``bf16: true``
    on a CPU without it is kept, with a warning naming the cost."""
    use_cpu = bool(grpo.get("use_cpu"))
    if grpo.get("bf16") == "auto":
        grpo["bf16"] = native_bf16(use_cpu)
    elif grpo.get("bf16") is True and use_cpu and not native_bf16(use_cpu):
        warnings.warn(
            "bf16: true on a CPU without AVX512-BF16 or AMX: torch emulates bf16 there, about 10x slower than "
            "fp32 (set bf16: false, or bf16: auto to use it only where it is native)",
            stacklevel=3,
        )


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML config (safe loader) and apply overrides; every key is checked and typed."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of field: value")
    raw = {**raw, **(overrides or {})}
    coord_fields = _field_types(CoordConfig)
    trl_fields = grpo_field_types()
    coord_kwargs: dict[str, Any] = {}
    grpo_kwargs: dict[str, Any] = {}
    known = sorted(set(coord_fields) | set(trl_fields))
    for key, value in raw.items():
        if key in coord_fields:
            coord_kwargs[key] = _coerce(key, value, coord_fields[key])
        elif key == "bf16" and str(value).lower() == "auto":
            grpo_kwargs[key] = "auto"  # resolved below, once use_cpu is known
        elif key in trl_fields:
            grpo_kwargs[key] = _coerce(key, value, trl_fields[key])
        else:
            raise _unknown(key, known)
    _resolve_bf16(grpo_kwargs)
    coord = CoordConfig(**coord_kwargs)
    if coord.protocol not in PROTOCOLS:
        raise ConfigError(f"protocol: must be one of {tuple(PROTOCOLS)}, got {coord.protocol!r}")
    if not coord.model:
        raise ConfigError("model: required (a local model folder or a hub id)")
    if coord.max_turns < 1:
        raise ConfigError("max_turns: must be >= 1")
    if coord.world_docs_per_chunk < 1:
        raise ConfigError(f"world_docs_per_chunk: must be >= 1, got {coord.world_docs_per_chunk}")
    if coord.world_train_docs is not None and (
        not coord.world_train_docs
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in coord.world_train_docs)
    ):
        raise ConfigError(
            f"world_train_docs: must be a non-empty list of document counts >= 1, got {coord.world_train_docs!r}"
        )
    _check_readers(coord)
    strategy = (
        str(grpo_kwargs.get("eval_strategy", "no")).split(".")[-1].lower()
    )  # an IntervalStrategy prints as its value
    if strategy != "no" and coord.eval_data is None:
        raise ConfigError(
            f"eval_strategy: {strategy!r} needs eval_data (a dataset folder, 'sample', 'world' or 'hmars_world'); set eval_data, "
            "or eval_strategy: no"
        )
    if coord.hmars is not None:
        known_hmars = {f.name for f in dataclasses.fields(get_protocol("hmars").config_cls)}
        bad = sorted(set(coord.hmars) - known_hmars)
        if bad:
            raise ConfigError(f"hmars: unknown key(s) {bad}; known: {sorted(known_hmars)}")
    grpo_kwargs.setdefault("max_tool_calling_iterations", coord.max_turns)
    if grpo_kwargs["max_tool_calling_iterations"] != coord.max_turns:
        raise ConfigError("max_tool_calling_iterations and max_turns disagree; set max_turns only")
    return TrainConfig(coord=coord, grpo=grpo_kwargs, source=str(path) if path else "")
