"""Model worker: model, weights, paged KV cache tensors, attention backends, sampler, ModelRunner."""
