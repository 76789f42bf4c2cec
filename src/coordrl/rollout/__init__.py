"""Policies and the episode runner shared by evaluation and inference: policy specs resolved and
loaded (`policy_source`), model names and checkpoint markers, the synthetic world's episode helpers,
and the tiny offline Qwen3 model."""
