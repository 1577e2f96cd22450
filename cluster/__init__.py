"""The engine's Ray parts: the Ray executor (one replica's ranks as actors), the worker actor and
placement."""
