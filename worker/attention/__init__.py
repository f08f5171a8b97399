"""Attention backends behind one interface (torch reference, Triton, flash-attn)."""
