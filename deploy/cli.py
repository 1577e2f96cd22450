"""The `raydix` command line.

`raydix serve` takes every `AppConfig` field as a flag (`--max-running-requests 32`), or a
YAML file of them (`--config serve.yaml`; flags win over the file). Without `--address` it
starts a local Ray inside this process; it logs when the app is ready and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from .config import AppConfig
from .config_file import describe_error, load_yaml
from .model_path import prepare_in_background
from .process_tree import descendants, end_all

if TYPE_CHECKING:
    from ray.serve import Application

logger = logging.getLogger("raydix")

APP_NAME = "raydix"
_NOT_FLAGS = {"autoscaling"}  # nested settings: YAML only
STOP_MARGIN_S = 5.0  # beyond shutdown_timeout: Serve ending the replicas it had to stop
PROCESS_GRACE_S = 10.0  # after ray.shutdown(): what it signalled ends on its own, or is killed
STOP_CHECK_S = 1.0  # how often the main thread wakes to run a stop signal's handler


class ConfigError(Exception):
    """Bad options: reported in one line, never as a traceback."""


def _flag_type(annotation: object) -> tuple[bool, list[str] | None]:
    """(is a plain on/off flag, allowed choices) for a field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        return True, None
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return False, [str(a) for a in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    return False, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydix", description="raydix LLM inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over OpenAI-compatible HTTP",
                           argument_default=argparse.SUPPRESS)
    serve.add_argument("--config", help="a YAML file of these options")
    for name, field in AppConfig.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        is_switch, choices = _flag_type(field.annotation)
        default = "" if field.default is None else f" (default: {field.default})"
        options = f"; one of {', '.join(choices)}" if choices else ""
        help_text = f"{field.description}{options}{default}"
        if is_switch:
            serve.add_argument(flag, dest=name, action="store_true", help=help_text)
        else:
            serve.add_argument(flag, dest=name, help=help_text)  # AppConfig checks values
    return parser


def load_config(args: argparse.Namespace) -> AppConfig:
    """The YAML file (if any) with the flags on top, checked by `AppConfig`."""
    values: dict[str, object] = {}
    path = getattr(args, "config", None)
    if path:
        try:
            values.update(load_yaml(path))
        except (OSError, ValueError) as e:
            raise ConfigError(f"can't read config file {path}: {e}") from e
    values.update({k: v for k, v in vars(args).items() if k not in ("command", "config")})
    try:
        return AppConfig.model_validate(values)
    except ValidationError as e:
        raise ConfigError(describe_error(e)) from e


def local_cpus_needed(config: AppConfig) -> int:
    """Logical CPUs the app reserves on a machine without GPUs: per replica its threads with
    tp 1, or one plus one per rank when tp > 1. A local Ray gets at least this many, so that
    tp 2 fits on 2 cores (the ranks share the cores; Ray's CPUs are only a count)."""
    replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
    if config.tp > 1:
        return replicas * (1 + config.tp)
    from .app import replica_cpu_threads

    return replicas * (replica_cpu_threads(config, "cpu", None) or 1)


def serve_forever(config: AppConfig) -> None:
    """Start (or join) Ray, deploy the app, log when it is ready, serve until SIGTERM or
    SIGINT; then stop (`_stop`)."""
    import ray
    from ray import serve

    from .app import build_app
    from .direct_ingress import direct_ingress_env, fallback_proxy_port, use_direct_ingress
    from .serve_env import export_for_local_ray, poll_serve_often

    _catch_stop_signals()
    poll_serve_often()
    logger.info("preparing the model %s", config.model)
    prepared = prepare_in_background(config)  # the default model is converted once (a progress bar)
    if config.address is None:
        check_port_free(config.host, config.port)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user instance
        export_for_local_ray()  # Serve's proxy and controller take its settings from here
        if use_direct_ingress(config):  # before the Ray whose processes read them
            os.environ.update(direct_ingress_env(config.port))
        num_cpus = max(os.cpu_count() or 1, local_cpus_needed(config))
        logger.info("starting a local Ray (%d CPUs)", num_cpus)
        # "local": a new instance even when another Ray runs on this machine (`ray start`),
        # which `ray.init()` would join instead; `--address auto` joins that one
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    else:
        logger.info("joining the Ray cluster at %s", config.address)
        ray.init(address=config.address)
    _catch_stop_signals()  # again: ray.init put its own SIGTERM handler in place
    try:
        proxy_port = config.port
        if use_direct_ingress(config):
            proxy_port = fallback_proxy_port(config.host)
            logger.info("the ingress replica serves HTTP itself (direct ingress); Serve's "
                        "fallback proxy listens on port %d", proxy_port)
        serve.start(http_options={"host": config.host, "port": proxy_port})
        prepared.result()
        app = build_app(config)
        logger.info("deploying %s engine replica(s) with tp=%d; the replicas load the model",
                    config.replicas if config.autoscaling is None else "autoscaled", config.tp)
        _deploy(app, config)
        _log_start_facts()
        logger.info("raydix is ready on http://%s:%d (model %r)", config.host, config.port,
                    config.model_name)
        wait_for_stop()
    except KeyboardInterrupt:
        logger.info("shutting down: requests in flight have %g s to finish",
                    config.shutdown_timeout)
    finally:
        _stop(config)


def _deploy(app: Application, config: AppConfig) -> None:
    """Run the app and return once it serves. When the cluster can't hold every engine replica
    yet but its autoscaler can add nodes that do, say so and wait up to
    `autoscaler_timeout_s` for them (a RuntimeError after that)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    from .app import ENGINE_DEPLOYMENT, replica_shortfall
    from .capacity import wait_for_nodes
    from .serve_env import STATUS_POLL_S

    shortfall = replica_shortfall(config)
    if shortfall is None:
        serve.run(app, name=APP_NAME, route_prefix="/")
        return
    serve.run_many([serve.RunTarget(app, name=APP_NAME, route_prefix="/")],
                   wait_for_applications_running=False)
    wait_for_nodes(shortfall, config.autoscaler_timeout_s,
                   lambda: replicas_running(APP_NAME, ENGINE_DEPLOYMENT))
    deadline = time.monotonic() + config.startup_timeout_s
    while serve.status().applications[APP_NAME].status != ApplicationStatus.RUNNING:
        replicas_running(APP_NAME, ENGINE_DEPLOYMENT)  # raises when the deploy failed
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app did not start within {config.startup_timeout_s:g} s")
        time.sleep(STATUS_POLL_S)


def replicas_running(app_name: str, deployment: str) -> int:
    """Replicas of `deployment` that run (0 until Serve reports the app); raises a
    RuntimeError when Serve gave up deploying the app."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    app = serve.status().applications.get(app_name)
    if app is None:
        return 0
    if app.status == ApplicationStatus.DEPLOY_FAILED:
        raise RuntimeError(f"deploying the app failed: {app.message}")
    status = app.deployments.get(deployment)
    if status is None:
        return 0
    return sum(n for state, n in status.replica_states.items() if state == "RUNNING")


def _log_start_facts() -> None:
    """What the engine replicas started with (their own log lines stay in their actors)."""
    from ray import serve

    from .app import ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    try:
        facts = handle.start_facts.remote().result(timeout_s=30)
    except Exception as e:  # the facts are a courtesy; serving goes on without them
        logger.warning("no start-up facts from the engine replicas: %r", e)
        return
    for line in facts.describe():
        logger.info("%s", line)


def _stop(config: AppConfig) -> None:
    """Stop taking requests, give those in flight `shutdown_timeout` seconds (the replicas'
    graceful shutdown, after which Serve ends them), then end the Ray instance this process
    started, or leave the cluster it joined. A second signal cuts the wait short."""
    import ray
    from ray import serve

    try:
        with contextlib.suppress(Exception):  # Serve may not have started
            serve.delete(APP_NAME, _blocking=False)
            deadline = time.monotonic() + config.shutdown_timeout + STOP_MARGIN_S
            while (APP_NAME in serve.status().applications
                   and time.monotonic() < deadline):
                time.sleep(0.1)
        if config.address is not None:
            _drop_router_actor(APP_NAME)  # detached: it would outlive the app on a cluster
    except KeyboardInterrupt:
        logger.info("stopping at once")
    finally:
        started = descendants(os.getpid())  # Ray's local processes among them
        ray.shutdown()  # a local instance ends with its processes; a joined one is left
        killed = end_all(started, PROCESS_GRACE_S)
        if killed:
            logger.warning("killed %d processes still running %g s after Ray's shutdown: %s",
                           len(killed), PROCESS_GRACE_S, ", ".join(killed))


def _drop_router_actor(app_name: str) -> None:
    import ray

    from raydix.router.actor import get_router

    with contextlib.suppress(ValueError):  # never made (another router, or no replica)
        ray.kill(get_router(app_name), no_restart=True)


def check_port_free(host: str, port: int) -> None:
    """Refuse a port that something on this machine listens on, in one line (Serve would
    retry its HTTP server for a minute and then fail without naming the port)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"can't listen on {host}:{port}: {e.strerror}") from e


def wait_for_stop() -> None:
    """Sleep until a stop signal's handler raises KeyboardInterrupt. Python runs a handler in
    the main thread when that thread next runs bytecode; a signal that the kernel hands to
    another thread (Ray's threads leave them unblocked) does not wake a main thread asleep in
    one long sleep, so it wakes every `STOP_CHECK_S` (a `kill` once waited out the hour)."""
    while True:
        time.sleep(STOP_CHECK_S)


def _catch_stop_signals() -> None:
    """SIGTERM (`kill`) stops as Ctrl-C does."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        return 2
    try:
        config = load_config(args)
    except ConfigError as e:
        print(f"raydix serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        serve_forever(config)
    except (FileNotFoundError, ValueError, RuntimeError, ConnectionError) as e:
        print(f"raydix serve: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
