"""Sampling: the batched sampler, token constraints, structured output's matchers, speculative drafts' verification."""
