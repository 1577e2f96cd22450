"""When the router actor ends: not before its application is gone.

The router actor is detached, so it outlives an engine replica's death and a worker node's loss,
but nothing ends it with its application. An ``AppWatch`` thread inside the actor does: every
``check_s`` it looks at when an engine replica last reported (a heartbeat at least every second,
``reporter.py``); after ``grace_s`` of silence it asks the Serve controller whether the
application still has a deployment. Only when it has none (or Serve itself is gone) does the
actor end. So:

- a live application's router never asks Serve anything (its replicas keep reporting);
- a replica restart (a model loading for minutes) keeps the router: Serve still has the app;
- an application deleted and deployed again within ``grace_s`` finds its router still there
  (``get_or_create_router`` reuses it);
- a deleted application's router is gone within ``grace_s + check_s`` (plus one controller call).

The check runs on its own thread and never touches the routing path. The end is a
``ray.kill(no_restart=True)`` of the actor by itself, dropped when a report arrived since the
decision (``RouterActor._end``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)

SERVE_CONTROLLER_NAME = "SERVE_CONTROLLER_ACTOR"  # ray.serve._private.constants
SERVE_NAMESPACE = "serve"
CONTROLLER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RouterLifetimeConfig:
    check_s: float = 5.0  # how often the watch thread wakes
    grace_s: float = 20.0  # replica silence after which Serve is asked whether the app is alive

    def __post_init__(self) -> None:
        if not (self.check_s > 0 and self.grace_s >= 0):
            raise ValueError(f"router lifetime needs check_s > 0 and grace_s >= 0, got {self}")


def app_in_serve(app_name: str) -> bool | None:
    """Whether Serve has a deployment of `app_name`; False when no Serve controller runs,
    None when the controller did not answer (then nobody knows: keep the router)."""
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False  # Serve shut down (or never started here)
    try:
        ids: list[object] = ray.get(controller.list_deployment_ids.remote(), timeout=CONTROLLER_TIMEOUT_S)
    except Exception as exc:  # restarting, or a Ray version without this method
        logger.warning("router of app %r: the Serve controller did not answer (%s)", app_name, exc)
        return None
    return any(getattr(d, "app_name", None) == app_name for d in ids)


class AppWatch:
    """The thread that decides the router's end. `heard()` is all the actor's report methods
    call (one clock read); `end` is called once, on the watch thread, when the app is gone."""

    def __init__(
        self,
        app_name: str,
        config: RouterLifetimeConfig,
        end: Callable[[float], None],
        in_serve: Callable[[str], bool | None] = app_in_serve,
    ) -> None:
        self.app_name = app_name
        self.config = config
        self.last_heard = time.monotonic()
        self._end = end
        self._in_serve = in_serve
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raydix-router-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch thread (the actor lives on as it is)."""
        self._stopped.set()
        self._thread.join()

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def app_gone(self) -> bool:
        """Silent for `grace_s` and not in Serve; the Serve question only after the silence."""
        if time.monotonic() - self.last_heard < self.config.grace_s:
            return False
        return self._in_serve(self.app_name) is False

    def _run(self) -> None:
        while not self._stopped.wait(self.config.check_s):
            try:
                if self.app_gone():
                    logger.info("app %r is gone: its router actor ends", self.app_name)
                    self._end(self.last_heard)  # the actor ends, or drops it: watch on
            except Exception:
                logger.warning("router of app %r: the lifetime check failed", self.app_name,
                               exc_info=True)
