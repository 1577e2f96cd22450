"""Ray Serve's own settings for raydix's processes, chosen for a token stream.

By default Serve runs a replica's code on a second event loop in a thread of its own, and a
handle's router on a third: every streamed item (a chunk of tokens from the engine replica, an
SSE chunk from the ingress) then crosses threads twice more on its way, and in the engine
replica those threads take the GIL from the engine's loop thread. raydix runs both on the
replica's main event loop, as Serve's throughput-optimized mode does (the engine steps in its own
thread whatever this says). Each setting can be overridden by exporting it before
`raydix serve`.

The settings reach raydix's replicas through their runtime environment (on any cluster) and,
for the local Ray that `raydix serve` starts, Serve's proxy and controller through the
environment they inherit.
"""

from __future__ import annotations

import os

SERVE_SETTINGS = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def serve_env() -> dict[str, str]:
    """The settings, each as this process's environment sets it, else raydix's choice."""
    return {name: os.environ.get(name, value) for name, value in SERVE_SETTINGS.items()}


def replica_runtime_env() -> dict[str, dict[str, str]]:
    """The runtime environment of raydix's Serve replicas."""
    return {"env_vars": serve_env()}


def export_for_local_ray() -> None:
    """Put the settings in this process's environment, for the Ray it is about to start."""
    os.environ.update(serve_env())
