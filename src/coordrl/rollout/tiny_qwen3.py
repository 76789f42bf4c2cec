"""A tiny, randomly initialised Qwen3 model on the offline tokenizer of `coordrl.data.tokenizer`."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from coordrl.data.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    load_shipped_tokenizer,
    save_tokenizer,
)

__all__ = ["build_tiny_qwen3"]


def build_tiny_qwen3(
    out_dir: str | Path,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    max_position_embeddings: int = 32768,
    seed: int = 0,
) -> Path:
    """Build a random-init ``Qwen3ForCausalLM`` and save it, with its tokenizer, to ``out_dir``.

    The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (no pickle weights) and
    the tokenizer files, and loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` or vLLM. Weights are float32
    with tied input/output embeddings. The same arguments and seed give a byte-identical ``model.safetensors``.

    Args:
        out_dir: output directory (created if needed).
        tokenizer: tokenizer to ship with the model; defaults to :func:`load_shipped_tokenizer`. The model's
            vocabulary size is ``len(tokenizer)``, so every id the model can emit decodes.
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size, max_position_embeddings:
            ``Qwen3Config`` shape. Keep ``head_dim`` at 64 or more for vLLM's CPU attention.
        seed: ``torch.manual_seed`` value used for the weight initialisation.

    Returns:
        ``Path(out_dir)``.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if tokenizer is None:
        tokenizer = load_shipped_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    if not isinstance(eos_id, int) or not isinstance(pad_id, int):
        raise ValueError(f"tokenizer must contain {EOS_TOKEN} and {PAD_TOKEN}")

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        # Qwen3's own base frequency (transformers' default is 10000), so long prompts see Qwen3-like positions.
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=pad_id,  # Qwen3 points bos at <|endoftext|> too, although its tokenizer adds no BOS
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A previous build with other settings may have left weights in another format or shard layout.
    for stale in list(out.glob("*.safetensors")) + list(out.glob("*.bin")) + list(out.glob("*.index.json")):
        stale.unlink()
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    return out
