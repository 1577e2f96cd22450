"""The engine replica as its own HTTP ingress: one fixed replica serves HTTP itself.

With one engine replica that can't grow (no autoscaling: `make serve`, one GPU) and one ingress
replica, nothing is left to route, and a separate ingress only adds a process to every token's
path: the engine replica sends each stream chunk over Serve's gRPC channel to the ingress, which
unpickles it and writes it to the client, on the same cores as the engine. So there the app
deploys one replica that is both (`deploy/app.py` `engine_serves_http`): the `OpenAIIngress`
whose engine is an `EngineServer` in its own process, reached through `LocalEngineHandle`, which
makes the calls the ingress makes through a `DeploymentHandle` as plain calls. A token then goes
from the engine process over its pipe to the replica, which writes it to the client (with direct
ingress, `direct_ingress.py`, the replica answers HTTP itself): the shape of Ray Serve LLM's
direct streaming. The ingress's code is the same (errors, the API key, /metrics, /health, the
abort of a stream whose client went away), and so is the engine replica's: the deployment keeps
the engine's name, resources, health check and methods (`HostsEngine`), so its start-up facts,
stats and ranks are asked for as before. `--separate-ingress` keeps the two deployments.

Faults: the replica's engine stopping fails each request in flight with a 503
(`engine_unavailable`), and the replica ends itself a moment later (`server.py`); Serve starts
another, and requests that arrive meanwhile wait for it in Serve's proxy. There is no other
replica to send a request to again, so a local request is never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from raydix.engine.engine_errors import EngineDeadError
from raydix.engine.request import GenerationParams, RequestOutput

from .errors import engine_unavailable

if TYPE_CHECKING:
    from raydix.engine.config import EngineConfig

    from .replica_facts import ReplicaFacts
    from .replica_stats import ReplicaStats
    from .server import EngineFactory, EngineServer, RankInfo, ReplicaSettings


class LocalEngine(NamedTuple):
    """What the ingress needs to build the engine replica in its own process."""

    config: EngineConfig
    settings: ReplicaSettings
    factory: EngineFactory


class LocalStream:
    """One engine request's outputs, as a `DeploymentResponseGenerator` gives them to the
    ingress (`__anext__`, `cancel`). The request reaches the engine at the first `__anext__`."""

    def __init__(self, outputs: AsyncIterator[list[RequestOutput]]) -> None:
        self._outputs = outputs
        self._closing: asyncio.Task[None] | None = None

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        try:
            return await self._outputs.__anext__()
        except EngineDeadError as e:  # no other replica to send it to: a 503 at once
            raise engine_unavailable(str(e)) from e

    def cancel(self) -> None:
        """Stop the request: closing its generator aborts it in the engine (its KV is freed).
        A generator that is running is being cancelled by its own task, which aborts it."""
        if self._closing is None:
            close = getattr(self._outputs, "aclose", None)
            if close is not None:
                self._closing = asyncio.ensure_future(close())
                self._closing.add_done_callback(_ignore_running)


def _ignore_running(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        with contextlib.suppress(RuntimeError):  # "asynchronous generator is already running"
            task.result()


class _Call:
    """`handle.method.remote(...)` for a method of this process's engine replica."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class LocalEngineHandle:
    """The ingress's handle to the engine replica when the replica is this process."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def options(self, **_: object) -> LocalEngineHandle:
        return self  # stream=True: a local request always streams

    @property
    def generate(self) -> _Call:
        def start(prompt_ids: Sequence[int], params: GenerationParams, rid: str) -> LocalStream:
            return LocalStream(self.server.generate(prompt_ids, params, rid))

        return _Call(start)

    @property
    def ping(self) -> _Call:
        return _Call(self.server.ping)


class HostsEngine:
    """The engine replica's methods on the ingress, for the replica that is both; an ingress of
    its own has no engine to answer for (`engine_server` None)."""

    engine_server: EngineServer | None = None

    def _server(self) -> EngineServer:
        if self.engine_server is None:
            raise RuntimeError("this ingress replica does not host an engine")
        return self.engine_server

    async def stats(self) -> ReplicaStats:
        return await self._server().stats()

    async def start_facts(self) -> ReplicaFacts:
        return await self._server().start_facts()

    async def ranks(self) -> tuple[RankInfo, ...]:
        return await self._server().ranks()

    async def ping(self) -> bool:
        return await self._server().ping()

    async def check_health(self) -> None:
        if self.engine_server is not None:
            await self.engine_server.check_health()

    def __del__(self) -> None:
        server = getattr(self, "engine_server", None)
        if server is not None:
            server.__del__()


def start_engine_server(local: LocalEngine, stats_board: Any) -> EngineServer:
    """The engine replica of this process (on the running event loop, as Serve builds one)."""
    from .server import EngineServer

    return EngineServer(local.config, local.settings, local.factory, stats_board, routing=None)


