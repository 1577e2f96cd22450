"""The engine: scheduler, request state, step protocol and TP group start-up on Ray."""
