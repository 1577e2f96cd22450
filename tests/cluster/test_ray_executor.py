"""The TP group of one replica on Ray, on fake GPUs (`ray.init(num_gpus=4)`) with gloo.

One Ray cluster serves the whole module. Worker actors take a fake GPU each (and no CPU), run
their shard on the CPU, and must give the same greedy tokens as one in-process worker and as
transformers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.ray_start import init_ray
from tests.tiny_models import save_tiny_llama

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from raydix.cluster.ray_executor import RayExecutor
from raydix.workers.config import WorkerConfig
from raydix.workers.step import ScheduledRequest, StepPlan, StepResult
from raydix.workers.worker import TPWorker
from tests.workers.driver import run_greedy, scenario
from tests.workers.reference import HFReference

pytestmark = pytest.mark.ray

NUM_GPUS = 4
MAX_NEW_TOKENS = 8
MAX_TOTAL_TOKENS = 512


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    init_ray(num_cpus=2, num_gpus=NUM_GPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0, vocab_size=256,
                           max_position_embeddings=256)


PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 128, 64], [200, 11, 11, 37, 90]]


def _configs(model: Path, tp_size: int) -> list[WorkerConfig]:
    return [
        WorkerConfig(
            str(model),
            tp_rank=r,
            tp_size=tp_size,
            device="cpu",
            dtype="float32",
            max_running_requests=4,
            max_context_len=64,
            max_total_tokens=MAX_TOTAL_TOKENS,
            # not compiled at each rank's start (seconds a process): decodes take the dense
            # copies here; the kernel's own tests are in tests/workers
            cpu_compiled_attention=False,
        )
        for r in range(tp_size)
    ]


def _greedy(step: Callable[[StepPlan], StepResult]) -> list[list[int]]:
    """Both prompts prefilled in one step (slots from page 1 up), then batched decode steps."""
    return run_greedy(step, scenario("whole", PROMPTS, MAX_NEW_TOKENS))


def _free_gpus() -> float:
    return ray.available_resources().get("GPU", 0.0)


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Ray frees resources and marks actors dead asynchronously: poll a little."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _live_placement_groups() -> list[str]:
    return [
        pg_id
        for pg_id, info in ray.util.placement_group_table().items()
        if info["state"] != "REMOVED"
    ]


def test_tp2_on_ray_matches_tp1_in_process_and_transformers(
    ray_cluster: None, llama_folder: Path
) -> None:
    expected = HFReference(llama_folder).greedy(PROMPTS, MAX_NEW_TOKENS)
    local = TPWorker(_configs(llama_folder, 1)[0])
    assert _greedy(local.step) == expected

    tp1 = RayExecutor(_configs(llama_folder, 1))  # device "cpu": one CPU bundle, no GPU
    try:
        assert _free_gpus() == NUM_GPUS
        assert ray.available_resources().get("CPU", 0.0) == 1.0
        assert tp1.max_num_tokens == local.max_num_tokens == MAX_TOTAL_TOKENS
        assert _greedy(tp1.step) == expected
    finally:
        tp1.shutdown()

    tp2 = RayExecutor(_configs(llama_folder, 2), use_gpu=True)
    try:
        assert _free_gpus() == NUM_GPUS - 2
        assert tp2.max_num_tokens == MAX_TOTAL_TOKENS
        assert _greedy(tp2.step) == expected
        # a plan that fails validation fails on every rank; the group keeps serving
        bad_row = StepPlan.build(99, [ScheduledRequest(4, 0, [1, 2], [1, 2])])
        with pytest.raises(ValueError, match=r"request rows \[4\] must be in \[0, 4\)"):
            tp2.step(bad_row)
        tp2.check_health()
        with ThreadPoolExecutor(1) as pool:  # a follower that left its loop would hang this
            assert pool.submit(_greedy, tp2.step).result(timeout=60) == expected
        # each rank's start-up heap is outside its collector's walks (workers/gc_heap.py)
        def heap_counts(actor: object) -> tuple[int, int]:  # in the actor (by value: nested)
            import gc

            return gc.get_freeze_count(), len(gc.get_objects())

        for frozen, walked in ray.get([a.__ray_call__.remote(heap_counts)
                                       for a in tp2._actors]):
            assert frozen > 50_000 and walked < frozen / 10
        # each CPU rank's process started with malloc on 2 MiB pages (workers/huge_pages.py)
        def tunables(actor: object) -> str:
            import os

            return os.environ.get("GLIBC_TUNABLES", "")

        for value in ray.get([a.__ray_call__.remote(tunables) for a in tp2._actors]):
            assert "glibc.malloc.hugetlb=1" in value.split(":")
    finally:
        tp2.shutdown()
    assert _wait_for(lambda: _free_gpus() == NUM_GPUS)


def test_replica_larger_than_cluster_fails_fast_and_cleans_up(
    ray_cluster: None, llama_folder: Path
) -> None:
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"can't be placed: the cluster has 4 GPU\(s\) free, "
        r"a replica needs tp=8 \(STRICT_PACK needs them on "
        r"one node",
    ):
        RayExecutor(_configs(llama_folder, 8), use_gpu=True, startup_timeout_s=2.0)
    assert time.monotonic() - start < 10.0
    assert _wait_for(lambda: not _live_placement_groups())
    assert _free_gpus() == NUM_GPUS


def test_startup_that_outlasts_its_timeout_fails_and_cleans_up(
    ray_cluster: None, llama_folder: Path
) -> None:
    # a fresh actor process can't import torch and load a model in 0.3 s
    with pytest.raises(RuntimeError, match=r"did not start within 0\.3 s"):
        RayExecutor(_configs(llama_folder, 2), use_gpu=True, startup_timeout_s=0.3)
    assert _wait_for(lambda: not _live_placement_groups())
    assert _wait_for(lambda: _free_gpus() == NUM_GPUS)


def test_rank_that_fails_to_start_is_named_and_cleaned_up(
    ray_cluster: None, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(
        RuntimeError,
        match=r"rank \d of the replica failed to start: "
        r"ValueError: architecture 'GPT2LMHeadModel' is not "
        r"supported",
    ):
        RayExecutor(_configs(tmp_path, 2), use_gpu=True, startup_timeout_s=60.0)
    assert _wait_for(lambda: not _live_placement_groups())
    assert _wait_for(lambda: _free_gpus() == NUM_GPUS)


def test_check_health_names_a_killed_rank(ray_cluster: None, llama_folder: Path) -> None:
    group = RayExecutor(_configs(llama_folder, 2), use_gpu=True)
    try:
        group.check_health()
        ray.kill(group.workers[1])

        def rank1_reported_dead() -> bool:
            try:
                group.check_health()
            except RuntimeError as e:
                assert "unhealthy rank(s) [1] of 2" in str(e)
                assert "rank 1: its actor died" in str(e)
                return True
            return False

        assert _wait_for(rank1_reported_dead)
        plan = StepPlan.build(0, [ScheduledRequest(0, 0, PROMPTS[0], range(1, 10))])
        with pytest.raises(RuntimeError, match=r"step 0 failed: unhealthy rank\(s\) \[1\]"):
            group.step(plan)
        with pytest.raises(RuntimeError, match="the TP group is broken"):
            group.step(plan)
    finally:
        group.shutdown()
    assert _wait_for(lambda: _free_gpus() == NUM_GPUS)
    assert not _live_placement_groups()


def test_shutdown_frees_gpus_and_keeps_a_given_placement_group(
    ray_cluster: None, llama_folder: Path
) -> None:
    # as Serve lays a replica out: one bundle for the engine, then one GPU bundle per rank
    pg = placement_group([{"CPU": 1}, {"GPU": 1}, {"GPU": 1}], strategy="STRICT_PACK")
    try:
        group = RayExecutor(
            _configs(llama_folder, 2), placement_group=pg, bundle_offset=1, use_gpu=True
        )
        assert _free_gpus() == NUM_GPUS - 2
        assert len(_greedy(group.step)[0]) == MAX_NEW_TOKENS
        group.shutdown()
        group.shutdown()  # a second call does nothing
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
        with pytest.raises(RuntimeError, match="shut down"):
            group.step(StepPlan.shutdown_plan())
    finally:
        remove_placement_group(pg)
    assert _wait_for(lambda: _free_gpus() == NUM_GPUS)

    too_small = placement_group([{"GPU": 1}] * 2)
    try:
        with pytest.raises(ValueError, match=r"bundles 2\.\.3 are needed for tp=2"):
            RayExecutor(
                _configs(llama_folder, 2), placement_group=too_small, bundle_offset=2, use_gpu=True
            )
    finally:
        remove_placement_group(too_small)
