"""Reader fleets and model clients: the frozen chunk readers (lexical, OpenAI-compatible / vLLM), the
chat endpoints of the HMARS roles, their shared HTTP client and retry policy, the reader prompt,
servers and the shared event loop. Below the environments: nothing here imports envs, rollout, train or inference."""
