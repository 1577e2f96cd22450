"""raydix: a Ray-based, tensor-parallel LLM inference cluster.

The product folders at the repository root (cache/, workers/, engine/, cluster/, router/,
deploy/) are installed as the subpackages ``raydix.cache``, ``raydix.workers`` and so on.
"""

__version__ = "0.1.0"
