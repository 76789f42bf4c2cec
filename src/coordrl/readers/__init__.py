"""Reader fleets: the frozen chunk readers (lexical, OpenAI-compatible / vLLM), their prompt, servers
and the shared event loop. Below the environments: nothing here imports envs, rollout, train or inference."""
