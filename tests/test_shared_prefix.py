"""The shared-prompt-prefix scoring pass (`share_prompt_prefix`) against TRL's own pass.

Both run on the tiny local Qwen3 inside a real `CoordGRPOTrainer`: the same log-probs, entropies and
gradients on left-padded prompts of different lengths and right-padded completions, and the same
loss over real TRL training steps.
"""

import math
from pathlib import Path

import torch

from coordrl.testing import scripted_trainer_class
from coordrl.train.config import load_config
from coordrl.train.run import build_trainer
from coordrl.train.trainer import CoordGRPOTrainer, _prompt_groups, new_prefix_stats

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def _cfg(tmp_path, name, **over):
    base = {
        "output_dir": str(tmp_path / name),
        "max_steps": 1,
        "eval_strategy": "no",
        "eval_data": "null",
        "report_to": "none",
        "save_strategy": "no",
        "traces": "false",
    }
    base.update({k: str(v) for k, v in over.items()})
    return load_config(TINY, base)


def _batch(vocab: int, pad: int, seed: int = 0):
    """Rows 0-2 share prompt A (9 tokens), rows 3-5 prompt B (6 tokens, left-padded), row 6 its own;
    completions of 2 to 7 tokens, right-padded to 7."""
    g = torch.Generator().manual_seed(seed)
    width, comp = 9, 7
    a = torch.randint(5, vocab, (width,), generator=g)
    b = torch.randint(5, vocab, (6,), generator=g)
    c = torch.randint(5, vocab, (width,), generator=g)
    prompts = [a, a, a, b, b, b, c]
    lengths = [7, 2, 5, 7, 4, 6, 3]
    ids = torch.full((len(prompts), width + comp), pad)
    mask = torch.zeros_like(ids)
    for r, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        ids[r, width - len(p) : width] = p
        mask[r, width - len(p) : width] = 1
        ids[r, width : width + n] = torch.randint(5, vocab, (n,), generator=g)
        mask[r, width : width + n] = 1
    return ids, mask, comp


def test_prompt_groups_key_on_tokens_and_mask():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    assert [g.tolist() for g in _prompt_groups(ids, mask)] == [[0, 1], [2], [3]]


def test_shared_prefix_pass_matches_trls_logps_entropies_and_gradients(tmp_path):
    trainer = build_trainer(_cfg(tmp_path, "run", share_prompt_prefix="true"))
    assert trainer.share_prompt_prefix
    model = trainer.model
    ids, mask, comp = _batch(model.config.vocab_size, trainer.processing_class.pad_token_id)
    live = mask[:, -comp:].bool()

    def run(shared: bool, batch_size=None):
        trainer.share_prompt_prefix = shared
        model.zero_grad()
        logps, ent, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, comp, batch_size, compute_entropy=True
        )
        (logps * live).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return logps.detach(), ent.detach(), grads

    before = dict(trainer.prefix_stats)
    plain = run(False)
    assert trainer.prefix_stats == before  # the plain pass is TRL's own
    for batch_size in (None, 2):
        logps, ent, grads = run(True, batch_size)
        assert logps.shape == plain[0].shape == (7, comp)
        assert torch.allclose(logps[live], plain[0][live], atol=1e-5), (logps - plain[0]).abs().max()
        assert torch.allclose(ent[live], plain[1][live], atol=1e-5)
        assert (logps[~live] == 0).all() and (ent[~live] == 0).all()  # padding scored as TRL scores it
        assert grads.keys() == plain[2].keys()
        for name, grad in grads.items():
            # Float rounding only: within 1e-5 of the tensor's largest entry (measured: about 1e-6).
            assert (grad - plain[2][name]).abs().max() <= 1e-5 * plain[2][name].abs().max(), name
    # Under activation checkpointing recomputed layers would append to the cache again: TRL's pass runs.
    model.gradient_checkpointing_enable()
    try:
        stats = dict(trainer.prefix_stats)
        logps, _, _ = run(True)
        assert trainer.prefix_stats == stats and torch.allclose(logps[live], plain[0][live], atol=1e-5)
    finally:
        model.gradient_checkpointing_disable()
    # Three prompts forwarded (8 shared tokens each) instead of seven full rows.
    assert trainer.prefix_stats["shared_calls"] == 2
    assert trainer.prefix_stats["tokens_forwarded"] == 2 * (3 * 8 + 7 * (comp + 1))
    assert trainer.prefix_stats["tokens_plain"] == 2 * ids.numel()


def test_grpo_steps_with_the_shared_prefix_give_trls_loss_and_entropy(tmp_path):
    logged = {}
    for shared in (False, True):
        trainer = build_trainer(
            _cfg(tmp_path, f"run-{shared}", share_prompt_prefix=str(shared).lower(), max_steps=2),
            trainer_cls=scripted_trainer_class(CoordGRPOTrainer, rounds=2),
        )
        trainer.train()
        logged[shared] = [(h["loss"], h["entropy"]) for h in trainer.state.log_history if "entropy" in h]
        # TRL's loss (and its old log-probs, when scored) went through the override.
        assert (trainer.prefix_stats["shared_calls"] > 0) == shared
    assert len(logged[True]) == len(logged[False]) == 2
    for a, b in zip(logged[True], logged[False], strict=True):
        # The entropy is the policy's over the completions: a wrong row, position or label would move it.
        assert b[1] > 0.1 and all(map(math.isfinite, a))
        assert abs(a[0] - b[0]) <= 1e-5 and abs(a[1] - b[1]) <= 1e-4 * b[1], logged


def _turn_rows(vocab: int, seed: int = 0) -> list[list[int]]:
    """What one generation call of the tool loop gets: rows that all start with the same 40 tokens (system
    prompt and tool schema), then two questions' tails, some rows grown by a completion and a tool result."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(5, vocab, (40,), generator=g).tolist()
    tails = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (6, 9)]
    grown = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (0, 3, 11, 0)]
    return [head + tails[r % 2] + grown[r % 4] for r in range(8)]


def test_shared_generation_prefix_gives_trls_completions(tmp_path):
    trainer = build_trainer(_cfg(tmp_path, "run", share_generation_prefix="true"))
    model = trainer.model
    rows = _turn_rows(model.config.vocab_size)

    def generate(shared: bool, sample: bool):
        trainer.share_generation_prefix = shared
        trainer.generation_config.do_sample = sample
        torch.manual_seed(7)
        completions, _ = trainer._backend_generate(rows, None, {}, num_generations=4)
        assert "generate" not in model.__dict__  # the call's own generate is gone after it
        return completions

    for sample in (False, True):
        before = dict(trainer.prefix_stats)
        plain = generate(False, sample)
        assert trainer.prefix_stats == before  # TRL's own generation
        assert generate(True, sample) == plain
        assert len({len(c) for c in plain}) > 1 or plain[0]  # something was generated
    stats = trainer.prefix_stats
    assert stats["generation_calls"] == 2
    # Rows 2 and 6 are equal past the head (17 tokens): the first 16 of them are forwarded once.
    assert stats["generation_prefill"] == 2 * (40 + sum(len(r) - 40 for r in rows) - 16)
    assert stats["generation_prefill_plain"] == 2 * len(rows) * max(len(r) for r in rows)


def test_common_prefix_scores_match_and_short_prefixes_fall_back(tmp_path):
    from transformers import GenerationConfig

    from coordrl.train.trainer import MIN_COMMON_PREFIX, _common_prefix_generate

    trainer = build_trainer(_cfg(tmp_path, "run"))
    model, pad = trainer.model, trainer.processing_class.pad_token_id
    rows = _turn_rows(model.config.vocab_size, seed=1)
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    config = GenerationConfig(
        max_new_tokens=6, do_sample=False, pad_token_id=pad, output_scores=True, return_dict_in_generate=True
    )
    plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    stats = new_prefix_stats()
    with _common_prefix_generate(model, stats):
        shared = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert stats["generation_calls"] == 1
    assert torch.equal(shared.sequences[:, width:], plain.sequences[:, width:])
    for a, b in zip(shared.scores, plain.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    # Rows that share fewer than MIN_COMMON_PREFIX tokens are generated as TRL generates them.
    short = ids.clone()
    short[0, width - len(rows[0]) + MIN_COMMON_PREFIX - 1] = (
        short[1, width - len(rows[1]) + MIN_COMMON_PREFIX - 1] + 1
    ) % 5 + 5
    with _common_prefix_generate(model, stats):
        model.generate(input_ids=short, attention_mask=mask, generation_config=config)
    assert stats["generation_calls"] == 1


def test_grouped_rows_share_their_prompt_and_generate_trls_completions(tmp_path):
    """GRPO's rows: each question's prompt repeated over its rollouts (first call), then grown by
    different completions and tool results (a tool round). Each question's prompt is forwarded once."""
    from transformers import GenerationConfig

    from coordrl.train.trainer import _common_prefix_generate

    trainer = build_trainer(_cfg(tmp_path, "run"))
    model, pad = trainer.model, trainer.processing_class.pad_token_id
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    head = torch.randint(5, vocab, (40,), generator=g).tolist()
    questions = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (30, 21)]
    grown = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (0, 5, 17, 2)]
    config = GenerationConfig(
        max_new_tokens=6, do_sample=False, pad_token_id=pad, output_scores=True, return_dict_in_generate=True
    )
    for tool_round in (False, True):
        rows = [head + questions[r // 4] + (grown[r % 4] if tool_round else []) for r in range(8)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        stats = new_prefix_stats()
        with _common_prefix_generate(model, stats):
            shared = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert torch.equal(shared.sequences, plain.sequences)
        for a, b in zip(shared.scores, plain.scores, strict=True):
            assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
        # The head once, each question's prompt once (but its last token: the group's first row is the bare
        # prompt, which keeps a token to prefill), then each row's own tokens.
        own = sum(1 + (len(grown[r % 4]) if tool_round else 0) for r in range(8))
        assert stats["generation_prefill"] == 40 + sum(len(q) - 1 for q in questions) + own
        assert stats["generation_prefill_plain"] == ids.numel()


def test_grpo_step_generates_from_the_common_prefix(tmp_path):
    trainer = build_trainer(_cfg(tmp_path, "run", share_generation_prefix="true", max_steps=1))
    trainer.train()
    # Every generation call of the step (first turn and tool rounds) started from the shared prefix.
    assert trainer.prefix_stats["generation_calls"] >= 1
    assert trainer.prefix_stats["generation_prefill"] < trainer.prefix_stats["generation_prefill_plain"] / 2
