"""Model families, one small module each, built from the shared decoder in ``decoder.py`` / ``causal_lm.py``;
``registry.py`` (no torch) says which module builds a checkpoint."""
