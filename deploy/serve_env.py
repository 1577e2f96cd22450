"""Ray Serve's own settings for raydix's processes, chosen for a token stream.

By default Serve sends each item a deployment streams (a chunk of tokens from the engine
replica, the SSE chunks from the ingress to the proxy) as a Ray object, and runs a handle's
router on an event loop in a thread of its own. raydix asks for what Serve's
throughput-optimized mode does on these points: items go over Serve's gRPC channel between its
processes (by value), and the handles' router runs on the replica's main event loop. Measured
with `benchmarks/serve_bench.py` (the tiny model on 2 cores, one run): the engine replica's CPU
per output token at one stream fell from 5.9-6.7 ms to 4.3-4.9 ms (the in-process engine's:
3.2-4.3 ms), the ingress's from 1.7-2.0 ms to 0.7-0.9 ms, and 64 streams went from 965-1120 to
1455-1481 tokens/s. Those runs came before `local_handle` (below): the ingress's handle to the
engine still sent chunks as Ray objects, so that gain is the other settings' and the proxy's
gRPC, not the engine stream's. Each setting can be overridden by exporting it before
`raydix serve`.

Serve's mode also runs a replica's code on its main event loop, and so does raydix in the
ingress, the stats board, and an engine replica whose rank runs inside it (tp 1 without GPU
bundles, as on a CPU): each token's chunk then goes from the engine's loop thread to the loop
that sends it, not through a second event loop in a thread of its own, one thread hop fewer
per chunk under the engine's GIL. The ingress's CPU per token at 16 and 64 streams: 0.3 ms with
it, 0.6-0.7 ms without (two runs at different times); the engine replica's at one stream of the
tiny model: 4.0 ms with it, 5.9-7.0 ms without, and 242-252 against 144-170 tokens/s (one
run, the variants back to back). An engine replica whose ranks are worker actors keeps Serve's
default: its constructor starts the ranks and waits for them, which would hold that loop (with
it, the TP=2 replicas of the multi-node fault test did not start their ranks within 60 s, in
one run on a loaded machine).

The settings reach raydix's replicas through their runtime environment (on any cluster) and,
for the local Ray that `raydix serve` starts, Serve's proxy and controller through the
environment they inherit. A handle handed to a replica was made, and pickled with its
options, in the process that built the app (`raydix serve`, `serve run`, a test), where Serve
read its transport default before these settings were set, or without them: it would send each
chunk as a Ray object. So each replica makes its handles anew (`local_handle`).
"""

from __future__ import annotations

import os
from typing import TypeVar, cast

from ray.serve.handle import DeploymentHandle

T = TypeVar("T")

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


STATUS_POLL_S = 0.1  # how often this process looks at an app's status while it waits on Serve


def poll_serve_often() -> None:
    """`serve.run` and `serve.delete` in this process look at the app's status every
    `STATUS_POLL_S`, not once a second (Ray's `CLIENT_POLLING_INTERVAL_S`, read by Serve's client
    at each wait): `raydix serve` said it was ready 0-1 s, half a second on average, after Serve
    ran the app, and stopped as much later after Serve deleted it. The same waits, the same
    checks and log lines; only the sleep between two looks is shorter."""
    from ray.serve._private import client

    if hasattr(client, "CLIENT_POLLING_INTERVAL_S"):  # a later Ray may wait otherwise
        client.CLIENT_POLLING_INTERVAL_S = STATUS_POLL_S


def local_handle(handle: DeploymentHandle[T]) -> DeploymentHandle[T]:
    """The same deployment's handle with this process's Serve settings (see above); anything
    else (a test's stand-in) as it is."""
    if not isinstance(handle, DeploymentHandle):
        return handle
    return cast(DeploymentHandle[T], DeploymentHandle(handle.deployment_name, handle.app_name))
