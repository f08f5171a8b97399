"""The paged KV cache's logical side: the block pool, the per-sequence tables and prefix cache, its events, the KV
connector and the tiers below the pool."""
