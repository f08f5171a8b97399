"""Inputs shared by the e2e tests and the reference outputs computed in conftest."""

PROMPTS = ["The capital of France is", "Once upon a time, there was a"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
