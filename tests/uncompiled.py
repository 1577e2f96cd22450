"""An engine factory for apps whose tests start many replica or rank processes: nothing is
compiled at a rank's start (the compiled CPU decode attention, the CPU decode and step graphs, seconds
in each process even from inductor's cache). For tests whose checks do not depend on how a
rank computes a step; tests/workers checks the compiled code, and tests/deploy/test_cli.py
serves through `raydix serve`'s defaults with it.

Replicas cannot import `tests`: register this module with `cloudpickle.register_pickle_by_value`
before binding an app to `uncompiled_engine`.
"""

from __future__ import annotations

from dataclasses import replace

from raydix.cache import EventSink
from raydix.deploy.server import ReplicaSettings
from raydix.engine.config import EngineConfig
from raydix.engine.engine import Engine


def uncompiled(config: EngineConfig) -> EngineConfig:
    return replace(config, worker=replace(config.worker, cpu_compiled_attention=False,
                                          cpu_decode_graph=False, cpu_step_graph=False))


def uncompiled_engine(config: EngineConfig, settings: ReplicaSettings,
                      event_sink: EventSink | None = None) -> Engine:
    """`build_engine` (the app's default factory) on the `uncompiled` config."""
    from raydix.deploy.server import build_engine

    return build_engine(uncompiled(config), settings, event_sink)
