"""The layers the model families are built of: tensor-parallel linear layers, rotary embeddings, the sparse
mixture-of-experts block, FP8 linear weights."""
