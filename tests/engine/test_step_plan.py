"""What the scheduler sends the ranks, asserted without a model.

A plan carries exactly the request table's changes since the last plan and each request's
sampling settings once, when it takes its row: a mirror that follows only the plans (as a rank
does) must hold, for every request of every step, the slots the cache manager holds.
"""

from __future__ import annotations

import numpy as np

from raydix.engine.batch import ScheduledBatch
from raydix.engine.config import SchedulerConfig
from raydix.engine.request import GenerationParams, Request
from raydix.engine.scheduler import Scheduler
from raydix.workers.step import RowSampling, SamplingParams, StepPlan, StepResult

EOS = 1


class RankMirror:
    """A rank's view: its request table and its sampling per row, from plans alone."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.table = np.zeros((config.max_running_requests, config.max_context_len), np.int32)
        self.sampling: dict[int, SamplingParams] = {}

    def run(self, plan: StepPlan, token: int = 7) -> StepResult:
        for row in plan.freed_rows:
            self.table[row] = 0
            self.sampling.pop(row, None)
        for w in plan.table_writes:
            self.table[w.row_idx, w.start: w.start + len(w.slot_ids)] = w.slot_ids
        for s in plan.new_sampling:
            self.sampling[s.row_idx] = s.sampling
        first = 0
        for row, prefix, num in zip(plan.row_idx, plan.prefix_lens, plan.extend_lens,
                                    strict=True):
            self.table[row, prefix: prefix + num] = plan.out_cache_loc[first: first + num]
            first += num
            assert row in self.sampling, f"row {row} runs with no sampling settings"
        n = plan.batch_size
        return StepResult(plan.step_id, np.full(n, token, np.int64), None, np.zeros(n, bool))


def _request(rid: str, prompt: list[int], **params: object) -> Request:
    ids = np.asarray(prompt, np.int32)
    return Request(rid, ids, GenerationParams(**params))  # type: ignore[arg-type]


def _step(sched: Scheduler, mirror: RankMirror, token: int = 7,
          ) -> tuple[ScheduledBatch, StepPlan]:
    scheduled = sched.schedule()
    assert scheduled is not None
    batch, plan = scheduled
    result = mirror.run(plan, token)
    for req, num in zip(batch.requests, batch.extend_lens, strict=True):
        assert req.row is not None
        end = req.kv_len + num  # what this step's forward reads
        np.testing.assert_array_equal(mirror.table[req.row, :end],
                                      sched.cache.req_to_token.table[req.row, :end])
        assert mirror.sampling[req.row] == req.sampling_now()
    sched.process(batch, result)
    return batch, plan


def test_plan_carries_new_requests_and_table_diffs_only() -> None:
    config = SchedulerConfig(max_running_requests=4, max_context_len=64, page_size=1)
    sched = Scheduler(config, num_pages=256, eos_token_ids=[EOS])
    mirror = RankMirror(config)
    sampling_a = SamplingParams(temperature=0.5, seed=3)
    a = _request("a", list(range(10, 22)), sampling=sampling_a, max_new_tokens=3)
    sched.add_request(a)

    _, plan = _step(sched, mirror)  # a's prompt, no cache hit
    row_a = a.row
    assert row_a is not None
    assert plan.new_sampling == (RowSampling(row_a, sampling_a),)
    assert plan.table_writes == () and plan.freed_rows == () and plan.penalty_starts == ()

    _, plan = _step(sched, mirror)  # decode: a's prompt went into the tree with its own slots
    assert (plan.new_sampling, plan.table_writes, plan.freed_rows) == ((), (), ())

    b = _request("b", list(range(10, 22)) + [40, 41], max_new_tokens=2)
    sched.add_request(b)
    _, plan = _step(sched, mirror)  # a's last token; b hits a's prompt
    assert b.row is not None and b.row != row_a
    assert plan.new_sampling == (RowSampling(b.row, b.params.sampling),)
    assert len(plan.table_writes) == 1
    write = plan.table_writes[0]
    assert (write.row_idx, write.start) == (b.row, 0)
    np.testing.assert_array_equal(write.slot_ids, mirror.table[row_a, :12])
    assert plan.freed_rows == ()
    assert a.finish_reason is not None

    _, plan = _step(sched, mirror)  # b decodes; a's row was freed after the last step
    assert plan.freed_rows == (row_a,)
    assert (plan.new_sampling, plan.table_writes) == ((), ())


def test_min_new_tokens_sends_sampling_again_only_when_it_changes() -> None:
    config = SchedulerConfig(max_running_requests=2, max_context_len=64)
    sched = Scheduler(config, num_pages=128, eos_token_ids=[EOS])
    mirror = RankMirror(config)
    req = _request("r", [5, 6, 7], max_new_tokens=6, min_new_tokens=2)
    sched.add_request(req)
    sent = []
    for _ in range(4):
        sent.append(_step(sched, mirror)[1].new_sampling)
    assert sent[0][0].sampling.banned_token_ids == (EOS,)
    assert sent[1] == ()
    assert sent[2] == (RowSampling(sent[0][0].row_idx, req.params.sampling),)
    assert sent[3] == ()


def test_random_workload_mirror_follows_the_cache() -> None:
    """Chunked prompts, shared prefixes, retraction and eviction: every step's rows match."""
    rng = np.random.default_rng(0)
    config = SchedulerConfig(max_running_requests=6, max_context_len=128, page_size=4,
                             max_prefill_tokens=48, chunked_prefill_size=16,
                             init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    sched = Scheduler(config, num_pages=40, eos_token_ids=[EOS])
    mirror = RankMirror(config)
    prefixes = [rng.integers(10, 100, 30).tolist() for _ in range(3)]
    for i in range(24):
        prompt = prefixes[i % 3] + rng.integers(10, 100, int(rng.integers(1, 20))).tolist()
        sched.add_request(_request(f"r{i}", prompt, max_new_tokens=int(rng.integers(1, 12))))
    steps = 0
    while sched.has_work:
        scheduled = sched.schedule()
        sched.take_early_outputs()
        if scheduled is None:
            continue
        batch, plan = scheduled
        result = mirror.run(plan, int(rng.integers(10, 100)))
        for req, num in zip(batch.requests, batch.extend_lens, strict=True):
            assert req.row is not None
            end = req.kv_len + num
            np.testing.assert_array_equal(mirror.table[req.row, :end],
                                          sched.cache.req_to_token.table[req.row, :end])
        sched.process(batch, result)
        sched.cache.check_integrity()
        steps += 1
    assert sched.stats.num_retractions > 0 and sched.stats.num_cached_tokens > 0
    assert steps > 20
