"""The model card (``README.md``) of an export: serving commands, files, settings, evaluation table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordrl.envs.protocols import get_protocol
from coordrl.rollout.policy_source import POLICY_META, is_hub_id

__all__ = ["VLLM_TOOL_FLAGS", "render_model_card"]

# vLLM flags that turn the export into an OpenAI tool-calling endpoint (Qwen family: hermes format).
VLLM_TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


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
        base_model=base if is_hub_id(base) else None,
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
        "Trained on HotpotQA-derived data (CC BY-SA 4.0); sources and licences: "
        "`src/coordrl/resources/data/ATTRIBUTION.md` in the coordrl repository.",
        "",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))
