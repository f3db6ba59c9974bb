"""The step board and data position, the global-order sampler, the loader, shards, collation."""
