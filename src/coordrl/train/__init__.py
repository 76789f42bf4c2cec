"""GRPO training of coordinator policies on TRL: config, trainer subclass, reward, launch plan."""
