"""Rollout helpers: tool-calling episodes and the tiny offline Qwen3 test model."""
