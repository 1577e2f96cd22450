"""Ray Serve's own settings for raydix's processes, chosen for a token stream.

By default Serve sends each item a deployment streams (a chunk of tokens from the engine
replica, the SSE chunks from the ingress to the proxy) as a Ray object, and runs a handle's
router on an event loop in a thread of its own. raydix asks for what Serve's
throughput-optimized mode does on these points: items go over Serve's gRPC channel between its
processes (by value), and the handles' router runs on the replica's main event loop. Measured
with `benchmarks/serve_bench.py` (the tiny model on 2 cores, one run): the engine replica's CPU
per output token at one stream fell from 5.9-6.7 ms to 4.3-4.9 ms (the in-process engine's:
3.2-4.3 ms), the ingress's from 1.7-2.0 ms to 0.7-0.9 ms, and 64 streams went from 965-1120 to
1455-1481 tokens/s. Each setting can be overridden by exporting it before `raydix serve`.

Serve's mode also runs a replica's code on its main event loop. raydix does so in the ingress
and the stats board (the ingress's CPU per token at 16 and 64 streams: 0.3 ms with it, 0.6-0.7
ms without, in two runs at different times). The engine replica keeps all of Serve's defaults:
the stream's transport is chosen by its caller (the ingress's handle), its own calls are only
the stats reports, running its code on the main loop made no measurable difference, and with it
the TP=2 replicas of the multi-node fault test did not start their ranks within 60 s (one run,
on a loaded machine; its constructor, which loads and starts the ranks, would hold that loop).

The settings reach the ingress and the stats board through their runtime environment (on any
cluster) and, for the local Ray that `raydix serve` starts, Serve's proxy and controller (and
the engine replicas) through the environment they inherit.
"""

from __future__ import annotations

import os

SERVE_SETTINGS = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
USER_CODE_ON_MAIN_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def serve_env(user_code_on_main_loop: bool = False) -> dict[str, str]:
    """The settings, each as this process's environment sets it, else raydix's choice."""
    chosen = SERVE_SETTINGS | (USER_CODE_ON_MAIN_LOOP if user_code_on_main_loop else {})
    return {name: os.environ.get(name, value) for name, value in chosen.items()}


def replica_runtime_env(user_code_on_main_loop: bool = False) -> dict[str, dict[str, str]]:
    """The runtime environment of raydix's Serve replicas."""
    return {"env_vars": serve_env(user_code_on_main_loop)}


def export_for_local_ray() -> None:
    """Put the settings in this process's environment, for the Ray it is about to start."""
    os.environ.update(serve_env())
