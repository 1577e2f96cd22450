"""Serve settings of the `raydix serve` process (deploy/serve_env.py)."""

from __future__ import annotations

import pytest


def test_serve_waits_are_polled_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """`raydix serve` has Serve's client look at the app's status every 0.1 s while
    `serve.run` and `serve.delete` wait (once a second by default: the ready line came up to a
    second late). Fails when a Ray upgrade drops the setting this relies on."""
    import inspect

    from ray.serve._private import client

    from raydix.deploy.serve_env import STATUS_POLL_S, poll_serve_often

    wait = inspect.getsource(client.ServeControllerClient._wait_for_application_running)
    assert "time.sleep(CLIENT_POLLING_INTERVAL_S)" in wait
    monkeypatch.setattr(client, "CLIENT_POLLING_INTERVAL_S", 1.0)  # Ray's own value
    poll_serve_often()
    assert client.CLIENT_POLLING_INTERVAL_S == STATUS_POLL_S == 0.1
