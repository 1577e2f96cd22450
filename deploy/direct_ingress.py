"""Direct ingress: the ingress replica answers HTTP on `--port` itself, not Serve's proxy.

Through Serve's proxy every SSE chunk takes one more hop: the ingress replica sends it to the
proxy over Serve's gRPC channel and the proxy writes it to the client, a process of its own
doing per-chunk work on the same cores as the engine. Ray Serve 2.60's direct ingress
(`RAY_SERVE_ENABLE_DIRECT_INGRESS`) runs the ingress deployment's ASGI app in an HTTP server
inside each ingress replica instead. The rest of the path is unchanged: the ingress still reads
and tokenizes the body and its handle (with the cache-aware router) picks the engine replica,
so errors, the API key, /metrics, /health and the abort of a stream whose client went away are
the same FastAPI code (`tests/deploy/test_direct_ingress.py`).

Serve gives each ingress replica a port from a per-node range, and keeps a proxy on the head
node on its own port as a fallback. raydix makes the range the one port `--port`, so the one
ingress replica of the node listens where the user asked, and the fallback proxy gets a free
port of its own. Its other settings: no minimum draining period (Serve's default keeps a
stopping ingress replica 30 s for a load balancer to notice; nothing stands in front of this
one, and a stop must take `--shutdown-timeout`), and no port quarantine (a restarted ingress
replica takes the same port again at once).

Used where that holds: a local Ray started by `raydix serve` (one node, whose Serve controller
this process starts with these settings) and one ingress replica. `--disable-direct-ingress`
keeps the proxy; so does a cluster joined with `--address` (its controller's settings are its
own) and `--ingress-replicas` above 1 (one port can't hold two servers).
"""

from __future__ import annotations

import socket

from .config import AppConfig


def use_direct_ingress(config: AppConfig) -> bool:
    """Whether `raydix serve` serves `config` through direct ingress (see above)."""
    return (not config.disable_direct_ingress and config.address is None
            and config.ingress_replicas == 1)


def direct_ingress_env(port: int) -> dict[str, str]:
    """Serve's settings for a local Ray whose one ingress replica listens on `port`."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive: one port
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def fallback_proxy_port(host: str) -> int:
    """A free port for Serve's head-node proxy, which direct ingress keeps as a fallback."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
