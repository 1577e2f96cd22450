"""Per-GPU model worker: model shards, KV pool tensors, attention backends, sampler."""
