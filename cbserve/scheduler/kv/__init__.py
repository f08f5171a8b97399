"""The paged KV cache's logical side: the block pool, the per-sequence tables and prefix cache, its events."""
