"""Deploying and deleting Serve apps in tests, looking every 0.1 s: `serve.run` and
`serve.delete` look once a second, so each returns about half a second after Serve is done."""

from __future__ import annotations

import time

from ray.serve import RunTarget


def run_apps(*targets: RunTarget, timeout_s: float = 180.0) -> None:
    """Deploy the apps as new apps and return once Serve runs them all (a failed deploy is
    raised with Serve's message). Not for a redeploy: until Serve takes the new version, the
    old one is listed as running."""
    from ray import serve

    serve.run_many(list(targets), wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    for target in targets:
        while True:
            status = serve.status().applications.get(target.name)
            if status is not None and status.status == "RUNNING":
                break
            if status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"app {target.name!r} failed to deploy: {status.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"app {target.name!r} not running {timeout_s:g} s after "
                                   "its deploy")
            time.sleep(0.1)


def delete_apps(*names: str, timeout_s: float = 60.0) -> None:
    """Delete the apps together and return once Serve lists none of them (`serve.delete`
    deletes one app at a time)."""
    from ray import serve

    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while set(names) & set(serve.status().applications):
        if time.monotonic() > deadline:
            raise TimeoutError(f"apps {names} still listed {timeout_s:g} s after their delete")
        time.sleep(0.1)
