"""The KV tiers below the pool, the worker's half: the RAM tier (tiers.py), the disk tier's files (disk.py) and the
shared-memory hand-off of prefill/decode disaggregation (shared.py)."""
