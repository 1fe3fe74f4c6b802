"""CPU-side bookkeeping: requests, block pool, KV cache manager, scheduler, the engine loop."""
