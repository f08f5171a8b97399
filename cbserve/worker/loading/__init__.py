"""Finding and loading a model: HF folders and GGUF files, their shapes without torch, building the model with its
weights."""
