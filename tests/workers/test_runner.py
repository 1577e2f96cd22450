"""The model runner's step protocol: table diffs, bounds checks, results; head sharding; sizing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from raydix.workers.broadcast import broadcast_plan
from raydix.workers.config import ModelConfig, WorkerConfig
from raydix.workers.parallel import SINGLE_RANK, HeadShard, head_shard
from raydix.workers.pool_sizing import kv_cell_size, profile_max_num_tokens
from raydix.workers.runner import ModelRunner
from raydix.workers.step import (
    PenaltyStart,
    RowSampling,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    TableWrite,
)

from .conftest import TinyModel


@pytest.fixture(scope="module")
def runner(tiny_models: dict[str, TinyModel]) -> ModelRunner:
    return ModelRunner(WorkerConfig(str(tiny_models["llama"].folder), page_size=4,
                                    max_running_requests=4, max_context_len=64,
                                    max_total_tokens=203))


def test_head_shard_uneven_and_replicated() -> None:
    # SmolLM2: 9 query heads, 3 KV heads over 2 ranks -> 2 + 1 KV heads
    assert head_shard(9, 3, 0, 2) == HeadShard(0, 6, 0, 2)
    assert head_shard(9, 3, 1, 2) == HeadShard(6, 3, 2, 1)
    # one KV head over 2 ranks: replicated, query heads split
    assert head_shard(4, 1, 0, 2) == HeadShard(0, 2, 0, 1)
    assert head_shard(4, 1, 1, 2) == HeadShard(2, 2, 0, 1)
    assert head_shard(8, 2, 3, 4) == HeadShard(6, 2, 1, 1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        head_shard(6, 2, 0, 3)


def test_pool_has_padding_page_and_page_aligned_capacity(runner: ModelRunner) -> None:
    cfg = runner.kv_pool.config
    assert runner.max_num_tokens == 200  # 203 capped, aligned down to pages of 4
    assert cfg.num_pages == 50 and cfg.num_slots == 51 * 4
    assert runner.kv_pool.k_buffers[0].shape == (204, 2, 16)


def test_cpu_budget_stands_in_for_free_memory(tiny_models: dict[str, TinyModel]) -> None:
    folder = str(tiny_models["llama"].folder)
    budget = 8 << 20
    r = ModelRunner(WorkerConfig(folder, cpu_memory_budget_bytes=budget, mem_fraction_static=0.9,
                                 max_running_requests=2, max_context_len=16,
                                 max_prefill_tokens=16))
    mc = ModelConfig.from_folder(folder)
    cell = kv_cell_size(mc.num_kv_heads, mc.head_dim, mc.num_layers, 4)
    assert r.headroom.total < 0.1 * budget  # the fraction keeps more than a step needs
    assert r.max_num_tokens == profile_max_num_tokens([budget - r.weight_bytes], budget, 0.9,
                                                      cell, 1, headroom=r.headroom)
    # a step of 1,024 prompt tokens needs more than the fraction keeps: the pool shrinks for it
    big = ModelRunner(WorkerConfig(folder, cpu_memory_budget_bytes=budget, mem_fraction_static=0.9,
                                   max_running_requests=2, max_context_len=16,
                                   max_prefill_tokens=1024))
    assert big.headroom.total > 0.1 * budget
    assert big.max_num_tokens == int((budget - big.weight_bytes - big.headroom.total) // cell)
    with pytest.raises(ValueError, match="Raise mem_fraction_static"):
        ModelRunner(WorkerConfig(folder, cpu_memory_budget_bytes=r.weight_bytes + 1000,
                                 mem_fraction_static=0.5))


def _plan(step_id: int, reqs: list[ScheduledRequest], **kw: object) -> StepPlan:
    return StepPlan.build(step_id, reqs, **kw)  # type: ignore[arg-type]


def test_table_diffs_and_results(runner: ModelRunner) -> None:
    prompt = [5, 6, 7, 8, 9, 10]
    r0 = runner.step(_plan(0, [ScheduledRequest(1, 0, prompt, [4, 5, 6, 7, 8, 9])]))
    assert r0 is not None
    assert runner.req_to_token[1, :6].tolist() == [4, 5, 6, 7, 8, 9]
    # row 2 reuses the first 4 slots of row 1, and extends 2 tokens of its own
    writes = [TableWrite(2, 0, np.array([4, 5, 6, 7], np.int32))]
    stop_token = int(r0.next_token_ids[0])
    params = SamplingParams(temperature=0.0, return_logprob=True, stop_token_ids=(stop_token,))
    r1 = runner.step(_plan(1, [ScheduledRequest(2, 4, prompt[4:], [12, 13], params)],
                           table_writes=writes))
    assert r1 is not None
    assert runner.req_to_token[2, :6].tolist() == [4, 5, 6, 7, 12, 13]
    # the same prompt through reused slots gives the same greedy token, flagged as a stop token
    assert r1.next_token_ids.tolist() == r0.next_token_ids.tolist()
    assert r1.stopped.tolist() == [True] and r0.stopped.tolist() == [False]
    assert r0.logprobs is None and r1.logprobs is not None
    logits = runner.forward(_plan(2, [ScheduledRequest(3, 0, prompt, [20, 21, 22, 23, 24, 25])]))
    expected = torch.log_softmax(logits[0].float(), -1)[stop_token].item()
    assert r1.logprobs[0] == pytest.approx(expected, abs=1e-5)
    # freeing a row points it back at the padding slot
    empty = runner.step(_plan(3, [], freed_rows=[1]))
    assert empty is not None and len(empty.next_token_ids) == 0
    assert runner.req_to_token[1].abs().sum().item() == 0


def test_bounds_are_checked(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="request rows"):
        runner.step(_plan(0, [ScheduledRequest(4, 0, [1], [4])]))
    with pytest.raises(ValueError, match="appears twice"):
        runner.step(_plan(0, [ScheduledRequest(0, 0, [1], [4]), ScheduledRequest(0, 1, [2], [5])]))
    with pytest.raises(ValueError, match="slot ids"):
        runner.step(_plan(0, [ScheduledRequest(0, 0, [1], [204])]))
    with pytest.raises(ValueError, match="max_context_len"):
        runner.step(_plan(0, [ScheduledRequest(0, 64, [1], [4])]))
    with pytest.raises(ValueError, match="outside max_context_len"):
        runner.step(_plan(0, [], table_writes=[TableWrite(0, 62, np.arange(4, 8, dtype=np.int32))]))
    with pytest.raises(ValueError, match="request rows"):
        runner.step(StepPlan.build(0, [], penalty_starts=[PenaltyStart(9, 3, np.arange(2))]))
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="frequency_penalty must be in"):
        SamplingParams(frequency_penalty=-2.5)


def test_plan_validation_and_pickling() -> None:
    with pytest.raises(ValueError, match="2 new tokens but 1 slots"):
        StepPlan.build(0, [ScheduledRequest(0, 0, [1, 2], [4])])
    with pytest.raises(ValueError, match="sum\\(extend_lens\\)"):
        StepPlan(0, np.array([0], np.int32), np.array([0], np.int32), np.array([2], np.int32),
                 np.array([1], np.int64), np.array([4], np.int32))
    plan = StepPlan.build(7, [ScheduledRequest(0, 3, [9], [11], SamplingParams(seed=3))],
                          freed_rows=[2])
    back = pickle.loads(pickle.dumps(plan))
    assert back.step_id == 7 and back.freed_rows == (2,) and back.new_sampling == plan.new_sampling
    assert plan.new_sampling == (RowSampling(0, SamplingParams(seed=3)),)
    assert back.input_ids.tolist() == [9] and back.out_cache_loc.tolist() == [11]
    assert broadcast_plan(plan, SINGLE_RANK) is plan


def test_config_errors(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        WorkerConfig("x", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="attention_backend"):
        WorkerConfig("x", attention_backend="xformers")
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})


def test_cuda_only_features_refuse_cpu(tiny_models: dict[str, TinyModel]) -> None:
    folder = str(tiny_models["llama"].folder)
    with pytest.raises(ValueError, match="needs CUDA"):
        ModelRunner(WorkerConfig(folder, attention_backend="flashinfer", max_total_tokens=64))
    with pytest.raises(ValueError, match="cuda_graph=True needs"):
        ModelRunner(WorkerConfig(folder, cuda_graph=True, max_total_tokens=64))


def test_graph_batch_buckets() -> None:
    from raydix.workers.cuda_graph import graph_batch_sizes

    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
