"""The host-only core of the engine; nothing here imports jax.

    sequence.py          a sequence's state (`Sequence`): prompt, output tokens, computed tokens, blocks
    scheduler.py         one iteration's schedule (`Scheduler.schedule` -> `SchedulerOutput`) and the
                         results applied back (`update`)
    in_flight.py         async scheduling's one rule: tokens still being drawn on the device
    kv_cache_manager.py  blocks for sequences: allocation, the prefix cache, swap
    block_pool.py        the block pool: free queue in eviction order, reference counts, prefix index
    block_hash.py        stable block hashes: digests chained from the model's identity (and a tenant's salt)
"""
