"""Reinforcement-learning support: pushing a trainer's new weights into running engines (weight_sync)."""
