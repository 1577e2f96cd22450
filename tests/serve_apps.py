"""Deploying and deleting Serve apps in tests, looking every 0.1 s: `serve.run` and
`serve.delete` look once a second, so each returns about half a second after Serve is done."""

from __future__ import annotations

import time

from ray.serve import RunTarget
from ray.serve.deployment import Application, Deployment

from raydix.deploy.server import ReplicaSettings


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


def engine_deployment(app: Application) -> Deployment:
    """The engine replicas' deployment of a bound raydix app: the app itself where the one
    engine replica is its own ingress (`deploy/engine_ingress.py`), else the ingress's engine
    argument."""
    from raydix.deploy.app import ENGINE_DEPLOYMENT

    if app._bound_deployment.name == ENGINE_DEPLOYMENT:
        return app._bound_deployment
    engine = next(a for a in app._bound_deployment.init_args if isinstance(a, Application))
    return engine._bound_deployment


def replica_settings_of(app: Application) -> ReplicaSettings:
    """What the bound app tells its engine replicas beyond the engine config."""
    deployment = engine_deployment(app)
    local = deployment.init_kwargs.get("local_engine")
    settings = local.settings if local is not None else deployment.init_args[1]
    assert isinstance(settings, ReplicaSettings)
    return settings
