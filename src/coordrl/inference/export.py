"""``coordrl export``: turn a training checkpoint into a servable Hugging Face model folder.

The export holds:

- the weights as safetensors only (pickled ``.bin`` / ``.pt`` weights are refused; a LoRA adapter is
  merged into its base model with peft when ``adapter_config.json`` is present);
- ``config.json`` / ``generation_config.json``;
- the tokenizer with the chat template TRL trained with: when the base model's template is not
  prefix-preserving, TRL swaps in its training template (`coordrl.envs.chat.ChatCodec`), and the
  export ships that template, so ``vllm serve`` and ``transformers`` render conversations exactly as
  training did; the tokenizer's ``response_template`` (TRL's tool-call parser) is saved with it;
- ``coordrl_policy.json``: protocol, tool schemas as rendered into the prompt, system prompt,
  answer format, reader settings and turn caps of training, evaluation defaults, coordrl version;
- ``README.md``: a model card, with the evaluation table of ``--eval DIR`` (or of a ``results.md``
  found next to the checkpoint).

`resolve_policy` reads any policy spec (``scripted``, a checkpoint, an export, a plain model folder or
a hub id) into a `PolicySource`: what ``coordrl eval`` and `Coordinator` load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordrl import __version__
from coordrl.data.build import fresh_partial
from coordrl.data.errors import DataError
from coordrl.envs.protocols import EVAL_CHUNK_TOKENS, EVAL_MAX_TURNS, PROTOCOLS, get_protocol

__all__ = [
    "EVAL_CHUNK_TOKENS",
    "EVAL_MAX_TURNS",
    "POLICY_META",
    "VLLM_TOOL_FLAGS",
    "PolicyError",
    "PolicySource",
    "check_checkpoint",
    "export_policy",
    "model_weights",
    "resolve_policy",
    "tool_schemas",
]

POLICY_META = "coordrl_policy.json"
POLICY_FORMAT_VERSION = 1
# vLLM flags that turn the export into an OpenAI tool-calling endpoint (Qwen family: hermes format).
VLLM_TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
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


# ---------------------------------------------------------------------------------------------------
# Reading policies
# ---------------------------------------------------------------------------------------------------


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


def _read_json(path: Path) -> dict[str, Any]:
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
        weight_map = _read_json(index).get("weight_map") or {}
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
    from coordrl.rollout.models import CHECKPOINT_META, COMPLETE_MARKER

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
    meta = _read_json(folder / CHECKPOINT_META)
    _check_protocol(folder, meta.get("protocol"))
    if not (folder / "config.json").exists():
        raise PolicyError(f"{folder}: incomplete checkpoint: config.json is missing")
    model_weights(folder)
    return meta


def _training_dir_hint(folder: Path) -> None:
    from coordrl.rollout.models import COMPLETE_MARKER, latest_complete_checkpoint

    if (folder / "final" / COMPLETE_MARKER).exists() or latest_complete_checkpoint(folder) is not None:
        best = folder / "final" if (folder / "final" / COMPLETE_MARKER).exists() else latest_complete_checkpoint(folder)
        raise PolicyError(f"{folder} is a training output folder; pass one of its checkpoints, e.g. {best}")


def _generation_from_config(config: dict[str, Any]) -> dict[str, Any]:
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
    from coordrl.envs.parser import ParserEnvConfig
    from coordrl.envs.prompts import LEAD_SYSTEM_PROMPT
    from coordrl.rollout.models import TINY_MODEL, resolve_model

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
            meta = _read_json(path / POLICY_META)
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
        from coordrl.rollout.models import CHECKPOINT_META

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
                generation=_generation_from_config(meta.get("config") or {}),
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
    if not _HUB_ID.fullmatch(text):
        raise PolicyError(f"policy {text}: no such folder (and not a hub id of the form org/name)")
    # A hub id: transformers resolves it (from the local cache when HF_HUB_OFFLINE=1).
    return PolicySource(
        text, "model", text, system_prompt=LEAD_SYSTEM_PROMPT, env=ParserEnvConfig().to_dict(), base_model=text
    )


def tool_schemas(protocol: str = "parser", env: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """JSON schemas of the protocol's tools (PARSER ``query_agents``, HMARS ``broadcast``) exactly as
    the chat template receives them under the environment settings ``env`` (default: the defaults;
    PARSER's tool description follows its ``activation``)."""
    from transformers.utils import get_json_schema

    from coordrl.envs.chat import env_tools

    spec = get_protocol(protocol)
    probe = spec.probe_env(spec.config(env) if env else None)
    return [get_json_schema(tool) for tool in env_tools(probe)]


# ---------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------


def _probe_ids(codec, protocol: str = "parser") -> tuple[list[int], list[int]]:
    """Ids of a probe conversation of ``protocol`` (prompt with its tools, tool call, tool result)
    and of a tool-result suffix."""
    from coordrl.envs.chat import env_tools

    tools = env_tools(get_protocol(protocol).probe_env())
    spec = get_protocol(protocol)
    prompt, args, result, name = (
        spec.prompt("Who wrote the novel?"),
        dict(spec.probe_arguments),
        spec.probe_result,
        spec.tool,
    )
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    tool_msg = {"role": "tool", "name": name, "content": result}
    convo = [*prompt, {"role": "assistant", "content": "", "tool_calls": [call]}, tool_msg]
    return codec.prompt_ids(convo, tools), codec.tool_suffix_ids([tool_msg])


def _merge_adapter(src: Path, dest: Path, meta: dict[str, Any]) -> None:
    try:
        from peft import PeftModel  # type: ignore[import-not-found]
    except ImportError:
        raise PolicyError(
            f"{src} holds a LoRA adapter (adapter_config.json); merging it into the base model needs peft, "
            "which is not installed (pip install peft)"
        ) from None
    from transformers import AutoModelForCausalLM

    from coordrl.rollout.models import resolve_model

    adapter_cfg = _read_json(src / "adapter_config.json")
    base_id = adapter_cfg.get("base_model_name_or_path") or meta.get("base_model")
    if not base_id:
        raise PolicyError(f"{src}/adapter_config.json names no base model (base_model_name_or_path)")
    try:
        base = AutoModelForCausalLM.from_pretrained(resolve_model(str(base_id)), use_safetensors=True, dtype="auto")
    except Exception as e:
        raise PolicyError(f"cannot load the adapter's base model {base_id!r}: {e}") from None
    merged = PeftModel.from_pretrained(base, str(src)).merge_and_unload()
    merged.save_pretrained(dest, safe_serialization=True)


def _training_step(src: Path, meta: dict[str, Any]) -> int | None:
    """The optimizer step of a checkpoint: trainer_state.json, else (``final``) the configured max_steps."""
    state = src / "trainer_state.json"
    try:
        if state.exists():
            return int(json.loads(state.read_text())["global_step"])
        steps = (meta.get("config") or {}).get("max_steps")
        return int(steps) if steps and int(steps) > 0 else None
    except (ValueError, KeyError, TypeError):
        return None


def _find_eval(src: Path, eval_dir: str | Path | None) -> Path | None:
    if eval_dir is not None:
        found = Path(eval_dir) / "results.md"
        if not found.exists():
            raise PolicyError(f"--eval {eval_dir}: no results.md there (run coordrl eval --out {eval_dir} first)")
        return found
    for candidate in (src.parent / "results.md", src.parent / "eval" / "results.md"):
        if candidate.exists():
            return candidate
    return None


def _policy_meta(src: Path, meta: dict[str, Any], template_source: str) -> dict[str, Any]:
    config = meta.get("config") or {}
    protocol = str(meta["protocol"])
    env = dict(meta.get("env") or {})
    env["tokenizer"] = None  # the export's own tokenizer; the training path means nothing elsewhere
    common = {
        "format": "coordrl-policy",
        "format_version": POLICY_FORMAT_VERSION,
        "coordrl_version": __version__,
        "trained_with_coordrl": meta.get("coordrl_version"),
        "protocol": protocol,
        "base_model": meta.get("base_model"),
        "exported_from": str(src.resolve()),
        "training_step": _training_step(src, meta),
        "system_prompt": meta.get("system_prompt"),
        "answer_format": meta.get("answer_format"),
        "tools": tool_schemas(protocol, env),
        "chat_template": template_source,
        "env": env,
    }
    spec = get_protocol(protocol)
    train_turns = env.get("max_turns") or config.get("max_turns")
    return {
        **common,
        "user_message_format": spec.user_message_format,
        spec.summary_key: {k: env.get(k) for k in spec.summary_fields},
        "turn_caps": {"train_max_turns": train_turns, "eval_max_turns": spec.eval_max_turns(None, train_turns)},
        **spec.policy_extras(env),
        "generation": _generation_from_config(config),
        "serving": {"vllm_serve_flags": list(VLLM_TOOL_FLAGS)},
    }


def export_policy(
    checkpoint: str | Path, out: str | Path, *, eval_dir: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Export a complete training checkpoint to ``out`` (see the module docstring); returns ``out``.

    Args:
        checkpoint: a ``checkpoint-<step>`` or ``final`` folder written by ``coordrl train``.
        out: the export folder; written to ``<out>.partial`` and renamed when complete.
        eval_dir: a ``coordrl eval --out`` folder whose ``results.md`` goes into the model card
            (default None: a ``results.md`` in the checkpoint's parent or its ``eval/`` folder, if any).
        overwrite: replace an existing non-empty ``out`` (default False: refuse).
    """
    from transformers import AutoConfig, AutoTokenizer

    from coordrl.data.tokenizer import save_tokenizer
    from coordrl.envs.chat import ChatCodec

    src = Path(checkpoint)
    meta = check_checkpoint(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise PolicyError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    if out.resolve() == src.resolve():
        raise PolicyError("--out must differ from --checkpoint")
    results_md = _find_eval(src, eval_dir)
    try:
        partial = fresh_partial(out, overwrite=True)  # emptiness was checked above, with the export's own message
    except DataError as e:
        raise PolicyError(str(e)) from None
    try:
        kind, files = model_weights(src)
        if kind == "adapter":
            _merge_adapter(src, partial, meta)
        else:
            for name in ("config.json", "generation_config.json"):
                if (src / name).exists():
                    shutil.copyfile(src / name, partial / name)
            for f in files:  # byte copies: the export decodes exactly like the checkpoint
                shutil.copyfile(f, partial / f.name)

        tokenizer = AutoTokenizer.from_pretrained(str(src))
        codec = ChatCodec(tokenizer)  # attaches TRL's response template when the tokenizer lacks one
        protocol = str(meta["protocol"])
        want_prompt, want_suffix = _probe_ids(codec, protocol)
        if codec.chat_template is not None:
            tokenizer.chat_template = codec.chat_template
            template_source = "trl-training (prefix-preserving template TRL swapped in for training)"
        else:
            template_source = "model (already prefix-preserving; TRL trained with it unchanged)"
        save_tokenizer(tokenizer, partial)

        # The export must render every conversation to the ids training produced.
        reloaded = ChatCodec(AutoTokenizer.from_pretrained(str(partial)))
        got_prompt, got_suffix = _probe_ids(reloaded, protocol)
        if reloaded.chat_template is not None or got_prompt != want_prompt or got_suffix != want_suffix:
            raise PolicyError(
                f"exported chat template of {src} does not reproduce the training token ids; export aborted"
            )

        policy_meta = _policy_meta(src, meta, template_source)
        (partial / POLICY_META).write_text(
            json.dumps(policy_meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        model_type = getattr(AutoConfig.from_pretrained(str(partial)), "model_type", "") or ""
        card = render_model_card(
            out, policy_meta, model_type, results_md.read_text(encoding="utf-8") if results_md else None
        )
        (partial / "README.md").write_text(card, encoding="utf-8")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and _HUB_ID.fullmatch(str(name)) is not None


def _shift_headings(markdown: str) -> str:
    """Embed another markdown document under a level-2 section: drop its title, demote headings."""
    lines = markdown.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("##" + line if line.startswith("#") else line for line in lines).strip()


def render_model_card(out: Path, meta: dict[str, Any], model_type: str, results_md: str | None) -> str:
    """The export's README.md: a Hugging Face model card, its metadata (front matter) written by
    `huggingface_hub.ModelCardData` so the Hub reads it as it reads any card; built offline, nothing is fetched."""
    from huggingface_hub import ModelCard, ModelCardData

    base = meta.get("base_model")
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        # Only a hub id links the card to its base model; a local training path would be a broken link.
        base_model=base if _is_hub_id(base) else None,
        tags=["coordrl", meta.get("protocol") or "parser", "tool-use", "grpo", "long-context"],
    )
    spec = get_protocol(meta.get("protocol") or "parser")
    qwen = model_type.lower().startswith("qwen")
    serve = f"vllm serve {out} {' '.join(VLLM_TOOL_FLAGS)}"
    step = meta.get("training_step")
    trained = (
        f"A coordinator policy for multi-agent long-document question answering, trained with coordrl "
        f"{meta.get('trained_with_coordrl') or ''} (GRPO on TRL) from `{base}`"
        + (f", step {step}" if step is not None else "")
    )
    about = spec.card_about.format(trained=trained, answer_format=meta.get("answer_format"))
    lines = [
        f"# {out.name}: {spec.title} coordinator",
        "",
        about,
        "",
        "## Files",
        "",
        "- `model.safetensors` (or shards), `config.json`, `generation_config.json`: the weights (safetensors only).",
        f"- tokenizer files and `chat_template.jinja`: chat template = {meta.get('chat_template')}.",
        f"- `{POLICY_META}`: protocol, tool schemas, system prompt, answer format, "
        + spec.card_settings
        + ", turn caps.",
        "",
        "## Serving with vLLM",
        "",
        "```bash",
        serve + ("" if qwen else "   # hermes fits Qwen-family templates; pick the parser of your model family"),
        "```",
        "",
        (
            "This is an OpenAI-compatible server with tool calling. coordrl itself talks to it through "
            "`/v1/completions` with token-id prompts (exactly the training tokens):"
        ),
        "",
        "```bash",
        f"coordrl answer --policy {out} --policy-url http://127.0.0.1:8000" + spec.answer_flags + " \\",
        "    --document doc.txt --question 'Who directed the film?'",
        "```",
        "",
        "```python",
        "from coordrl.inference.coordinator import Coordinator",
        "",
        f'coord = Coordinator.from_pretrained("{out}", ' + spec.answer_kwargs + 'policy_url="http://127.0.0.1:8000")',
        'result = coord.answer(open("doc.txt").read(), "Who directed the film?")',
        "print(result.answer, result.evidence)",
        "```",
        "",
        *spec.card_section(meta, POLICY_META),
        "",
        "Tool schema, as rendered into the prompt:",
        "",
        "```json",
        json.dumps(meta.get("tools"), indent=2),
        "```",
        "",
        "System prompt:",
        "",
        "```text",
        str(meta.get("system_prompt")),
        "```",
        "",
        "## Evaluation",
        "",
        _shift_headings(results_md)
        if results_md
        else "No evaluation attached (run `coordrl eval` and export with `--eval DIR`).",
        "",
        "## Licence and data",
        "",
        "Trained on HotpotQA-derived data (CC BY-SA 4.0); see the coordrl repository's ATTRIBUTION.md.",
        "",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))
