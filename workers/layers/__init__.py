"""Tensor-parallel building blocks. Each parallel layer loads its own shard (`weight_loader`)."""
