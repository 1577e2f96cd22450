"""A simulated multi-node cluster (`ray.cluster_utils.Cluster`): one for the package, with one
app of two TP=2 replicas that every module uses (test_faults.py first, test_nodes.py last: its
node-loss test removes a node and adds one back).

The head node holds no GPU; each worker node has `GPUS_PER_NODE` fake GPUs and one CPU, so a
TP=2 replica (one CPU bundle for its engine, two GPU bundles for its ranks, STRICT_PACK) fills a
node. Node deaths are noticed in about 1.5 s (fast GCS health checks). The model is a tiny
random Llama with a byte-level tokenizer made here, so nothing is converted or downloaded.

Every wait is bounded (`wait_until`), so a fault that hangs fails the test instead of CI.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import openai
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray
from ray import serve
from ray._private.node import Node
from ray.actor import ActorHandle
from ray.cluster_utils import Cluster
from ray.serve.handle import DeploymentHandle

from raydix.deploy.app import ENGINE_DEPLOYMENT, STATS_BOARD_DEPLOYMENT
from raydix.deploy.config import AppConfig
from raydix.deploy.server import RankInfo, ReplicaStats

GPUS_PER_NODE = 2
NUM_GPU_NODES = 2
MODEL_NAME = "tiny"
APP = "multinode"
T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str,
               period_s: float = 0.2) -> T:
    """Poll `predicate` until it returns a truthy value (returned); fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(period_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="package")
def engine(sim_cluster: SimCluster, tiny_model: Path) -> DeploymentHandle:
    """The app every module checks, deployed once (the cluster goes with the package)."""
    return deploy(APP, app_config(tiny_model))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 KV heads, so TP=2 splits them) with a byte-level tokenizer:
    one token per byte, ids 2..257; 0 and 1 are BOS and EOS."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1} | {ch: 2 + i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    folder = tmp_path_factory.mktemp("tiny-model")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(folder)
    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


class SimCluster:
    """The running cluster, and Serve on it (HTTP on `base_url`, proxy on the head only)."""

    def __init__(self, cluster: Cluster, port: int) -> None:
        self.cluster = cluster
        self.base_url = f"http://127.0.0.1:{port}"

    def client(self, app: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/{app}/v1", api_key="none",
                                  max_retries=0, timeout=120)

    def add_gpu_node(self) -> Node:
        return add_gpu_node(self.cluster)

    def gpu_nodes(self) -> dict[str, Node]:
        """Live worker nodes by node id."""
        return {n.node_id: n for n in self.cluster.worker_nodes}


NODE_START_ATTEMPTS = 3


def start_node(start: Callable[[], T]) -> T:
    """Run `start` (which starts one Ray node), again if the node misses Ray's registration wait.

    Ray gives a new node a fixed 30 s to register with the GCS, and a CI run on two loaded cores
    has missed it once (as `tests/ray_start.py` says of `ray.init`). A start that times out is
    stopped (the half-started node's processes are killed, so no late node joins the cluster)
    and tried again, with a warning and the raylet's log tail on stderr; any other failure, or
    the last attempt's, is raised."""
    for attempt in range(1, NODE_START_ATTEMPTS + 1):
        try:
            return start()
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == NODE_START_ATTEMPTS:
                raise
            warnings.warn(f"a Ray node start timed out, starting it again: {exc}", stacklevel=2)
            _stop_half_started_node(exc)
    raise AssertionError("unreachable")


def _stop_half_started_node(exc: BaseException) -> None:
    """Kill the processes of the node whose `Node.__init__` raised `exc`, printing its raylet's
    log tail to stderr (pytest shows it with the test's output)."""
    tb = exc.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            logs = Path(node.get_logs_dir_path())
            for log in sorted(logs.glob("raylet*"), key=lambda f: f.stat().st_mtime)[-2:]:
                tail = log.read_text(errors="replace").splitlines()[-20:]
                print(f"--- {log} (a node start that timed out)", *tail, sep="\n",
                      file=sys.stderr)
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            return
        tb = tb.tb_next
    raise AssertionError("the node that failed to start was not found") from exc


def add_gpu_node(cluster: Cluster) -> Node:
    """Start one worker node with `GPUS_PER_NODE` fake GPUs and one CPU."""
    return start_node(lambda: cluster.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE))


@pytest.fixture(scope="package")
def sim_cluster() -> Iterator[SimCluster]:
    cluster = start_node(lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500,
                           "health_check_failure_threshold": 3}}))
    try:
        for _ in range(NUM_GPU_NODES):
            add_gpu_node(cluster)
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield SimCluster(cluster, port)
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def app_config(model: Path, **overrides: object) -> AppConfig:
    """Two TP=2 replicas on fake GPUs, small and quick to check on."""
    settings: dict[str, object] = dict(
        model=str(model), served_model_name=MODEL_NAME, device="cpu", use_gpu_bundles=True,
        tp=2, replicas=2, max_total_tokens=4096, max_running_requests=32,
        max_context_len=512, health_check_period_s=1.0, startup_timeout_s=120.0,
        debug_cache_audit=True,
        # the fault tests send streams that share a prefix to the replica holding it, then fail
        # that replica: the threshold policy keeps them together where ttft would spread them
        # by load (routing itself is tested in tests/router)
        routing_policy="threshold")
    settings.update(overrides)
    return AppConfig(**settings)  # type: ignore[arg-type]


def deploy(app: str, config: AppConfig, timeout_s: float = 240.0) -> DeploymentHandle:
    """Deploy the real app under `app`, its ranks compiling nothing at start (about a dozen
    rank processes start here, restarts included), and wait (bounded) until it runs."""
    from ray import cloudpickle

    from raydix.deploy.app import bind_app
    from tests import uncompiled

    cloudpickle.register_pickle_by_value(uncompiled)  # replicas can't import tests
    serve.run_many([serve.RunTarget(bind_app(config, engine_factory=uncompiled.uncompiled_engine),
                                    name=app, route_prefix=f"/{app}")],
                   wait_for_applications_running=False)
    wait_until(lambda: _app_running(app), timeout_s, f"app {app!r} to run")
    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app)


def _app_running(app: str) -> bool:
    status = serve.status().applications.get(app)
    if status is not None and status.status == "DEPLOY_FAILED":
        pytest.fail(f"app {app!r} failed to deploy: {status.message}")
    return status is not None and status.status == "RUNNING"


def running_replica_ids(app: str) -> set[str]:
    """The engine replicas the Serve controller lists as running."""
    from ray.serve._private.common import DeploymentID, ReplicaState

    controller = serve.context._global_client._controller
    infos = ray.get(controller._dump_replica_states_for_testing.remote(
        DeploymentID(name=ENGINE_DEPLOYMENT, app_name=app)), timeout=30)
    return {r.replica_id.unique_id for r in infos.get([ReplicaState.RUNNING])}


def replica_stats(app: str) -> dict[str, ReplicaStats]:
    """The latest stats of each running engine replica, by replica id (from the stats board,
    which every replica reports to each second)."""
    board = serve.get_deployment_handle(STATS_BOARD_DEPLOYMENT, app_name=app)
    running = running_replica_ids(app)
    stats = board.snapshot.remote().result(timeout_s=30)
    return {s.replica_id: s for s in stats if s.replica_id in running}


def all_replica_stats(app: str, num: int, timeout_s: float = 30.0) -> dict[str, ReplicaStats]:
    """Stats of `num` running replicas (waits until the board has them all)."""
    def complete() -> dict[str, ReplicaStats] | None:
        stats = replica_stats(app)
        return stats if len(stats) == num else None

    return wait_until(complete, timeout_s, f"stats of {num} running replicas")


def replica_ranks(engine: DeploymentHandle, replica_ids: set[str],
                  timeout_s: float = 30.0) -> dict[str, tuple[RankInfo, ...]]:
    """Each listed replica's ranks. A handle call reaches some replica (the router picks one
    at random for calls without a prompt), so call until each has answered."""
    found: dict[str, tuple[RankInfo, ...]] = {}

    def ask() -> bool:
        for call in [engine.ranks.remote() for _ in range(4)]:
            ranks = call.result(timeout_s=timeout_s)
            found[ranks[0].replica_id] = ranks
        return replica_ids <= set(found)

    wait_until(ask, timeout_s, f"the ranks of replicas {sorted(replica_ids)}")
    return {r: found[r] for r in replica_ids}


def router_of(app: str) -> ActorHandle:
    from raydix.router.actor import get_router

    return get_router(app)


def router_view(router: ActorHandle, replica_id: str) -> tuple[bool, int]:
    """(whether the router lists `replica_id`, how many cached prefixes its tree credits it)."""
    known = replica_id in ray.get(router.replica_ids.remote(), timeout=30)
    held = ray.get(router.__ray_call__.remote(
        lambda actor, rid: len(actor.state.tree.holdings(rid)), replica_id), timeout=30)
    return known, held


def node_of(actor: ActorHandle) -> str:
    return str(ray.get(actor.__ray_call__.remote(
        lambda _: ray.get_runtime_context().get_node_id()), timeout=30))
