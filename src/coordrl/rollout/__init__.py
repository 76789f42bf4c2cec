"""Reader fleets (lexical, OpenAI-compatible/vLLM), reader servers, policies and the episode runner
shared by evaluation and inference, plus the tiny offline Qwen3 model used by tests and the demo."""
