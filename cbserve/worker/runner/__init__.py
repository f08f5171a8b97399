"""The model runner and what runs one step: the persistent batch, the KV tensors, the step's guard, pooling, prompt
logprobs, the draft model, the executor."""
