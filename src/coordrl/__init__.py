"""coordrl: reinforcement learning for the coordinator of a multi-agent long-document reader.

A trainable coordinator (the PARSER lead agent, or the HMARS mid-agent) never reads the document:
it queries frozen chunk readers over several rounds and answers. coordrl builds the data, runs the
environments, trains the coordinator with TRL's GRPO, evaluates it and exports it.
"""

__version__ = "0.1.0"
