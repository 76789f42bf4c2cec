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

Reading checkpoints and exports back (`resolve_policy`, `check_checkpoint`) lives in
`coordrl.rollout.policy_source`, below evaluation and inference, which both load policies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from coordrl import __version__
from coordrl.data.build import fresh_partial
from coordrl.data.errors import DataError
from coordrl.data.tokenizer import save_tokenizer
from coordrl.envs.chat import ChatCodec, env_tools
from coordrl.envs.protocols import get_protocol
from coordrl.inference.model_card import VLLM_TOOL_FLAGS, render_model_card
from coordrl.rollout.models import resolve_model
from coordrl.rollout.policy_source import (
    POLICY_META,
    PolicyError,
    check_checkpoint,
    generation_from_config,
    model_weights,
    read_json,
)

__all__ = ["export_policy", "tool_schemas"]

POLICY_FORMAT_VERSION = 1


def tool_schemas(protocol: str = "parser", env: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """JSON schemas of the protocol's tools (PARSER ``query_agents``, HMARS ``broadcast``) exactly as
    the chat template receives them under the environment settings ``env`` (default: the defaults;
    PARSER's tool description follows its ``activation``)."""
    from transformers.utils import get_json_schema

    spec = get_protocol(protocol)
    probe = spec.probe_env(spec.config(env) if env else None)
    return [get_json_schema(tool) for tool in env_tools(probe)]


# ---------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------


def _probe_ids(codec, protocol: str = "parser") -> tuple[list[int], list[int]]:
    """Ids of a probe conversation of ``protocol`` (prompt with its tools, tool call, tool result)
    and of a tool-result suffix."""
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

    adapter_cfg = read_json(src / "adapter_config.json")
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
        "generation": generation_from_config(config),
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
