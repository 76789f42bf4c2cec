"""Fails loudly when TRL internals that coordrl relies on change shape (coordrl pins trl 1.16.x).

coordrl overrides or calls: GRPOTrainer._tool_call_loop (concurrent tools), _generate_single_turn
(lock-step), _get_tool_suffix_ids (ChatCodec), and reads reward kwargs `environments` /
`log_metric`. If one of these assertions fails after a TRL upgrade, re-check the override before
changing the pin.
"""

import inspect

import trl
from trl import GRPOTrainer

from coordrl.train.trainer import CoordGRPOTrainer


def test_trl_version_is_pinned_minor():
    assert trl.__version__.startswith("1.16."), trl.__version__


def test_tool_loop_signature_and_serial_dispatch_still_match():
    sig = inspect.signature(GRPOTrainer._tool_call_loop)
    assert list(sig.parameters) == [
        "self",
        "prompts",
        "prompt_ids",
        "completion_ids",
        "completions",
        "logprobs",
        "images",
        "multimodal_fields",
    ]
    src = inspect.getsource(GRPOTrainer._tool_call_loop)
    # The per-rollout dicts our batcher swaps in are read by rollout index inside the loop ...
    assert "self._sync_tool_dicts[idx_with_tool]" in src and "self._async_tool_dicts[idx_with_tool]" in src
    assert 'sync_tool_dict[name](**function["arguments"])' in src
    # ... the loop appends tool messages to `completions` (the batcher's round key) ...
    assert "completions[idx_with_tool].append(tool_message)" in src
    # ... and generates each round through _generate_single_turn.
    assert "self._generate_single_turn(" in src
    ret = "return tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images"
    assert ret in src


def test_generation_and_suffix_helpers_still_match():
    sig = inspect.signature(GRPOTrainer._generate_single_turn)
    assert list(sig.parameters) == [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ]
    assert list(inspect.signature(GRPOTrainer._get_tool_suffix_ids).parameters) == ["self", "tool_messages"]
    src = inspect.getsource(GRPOTrainer._get_tool_suffix_ids)
    for attr in (
        "self.processing_class",
        "self.chat_template",
        "self.chat_template_kwargs",
        "self._is_vlm",
        "self._tokenizer",
    ):
        assert attr in src  # the attributes ChatCodec provides to it
    rewards_src = inspect.getsource(GRPOTrainer._calculate_rewards)
    assert 'reward_kwargs["environments"]' in rewards_src and 'reward_kwargs["log_metric"]' in rewards_src


def test_scoring_pass_signature_and_fused_head_still_match():
    # share_prompt_prefix overrides the scoring pass: same parameters, and TRL's pass must still be the
    # fused LM head over labels masked by attention, keeping the last logits_to_keep positions.
    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    assert params[:8] == [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ]
    src = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)" in src
    assert "labels[:, :-logits_to_keep] = -100" in src
    assert "model(**model_inputs, labels=labels, fused_lm_head=True)" in src
    assert "outputs.log_probs[:, -logits_to_keep:]" in src and "outputs.entropy[:, -logits_to_keep:]" in src
    # The loss and the old/reference log-probs all score through it.
    assert "self._get_per_token_logps_and_entropies(" in inspect.getsource(GRPOTrainer._compute_loss)
    assert "self._get_per_token_logps_and_entropies(" in inspect.getsource(GRPOTrainer._generate_and_score_completions)


def test_our_overrides_are_the_ones_that_run():
    for name in ("_tool_call_loop", "_generate_single_turn", "_get_per_token_logps_and_entropies"):
        assert getattr(CoordGRPOTrainer, name) is not getattr(GRPOTrainer, name)
        assert getattr(CoordGRPOTrainer, name).__qualname__.startswith("CoordGRPOTrainer.")
    # GRPOTrainer's tool loop calls self._generate_single_turn, so the override is reached from TRL's code.
    assert "self._generate_single_turn(" in inspect.getsource(GRPOTrainer._generate)


def test_observation_mask_ablation_hook_still_matches():
    # mask_observations=False drops "tool_mask" from the batch; TRL must still treat it as optional.
    gen = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert 'output["tool_mask"] = tool_mask' in gen
    assert '"tool_mask" not in inputs' in inspect.getsource(GRPOTrainer._compute_loss)
    assert CoordGRPOTrainer._generate_and_score_completions is not GRPOTrainer._generate_and_score_completions
