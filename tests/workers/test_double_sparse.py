"""The double-sparse KV pool: equal to dense attention when the token budget covers the
context (through the sparse path: labels, top-k, gather), equal to dense attention over the
top-scored tokens when it does not, and its heavy channels from a file or a calibration prompt."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from raydix.workers.attention.base import ForwardBatch
from raydix.workers.attention.double_sparse_backend import DoubleSparseBackend
from raydix.workers.config import WorkerConfig
from raydix.workers.kv_pool import DoubleSparseKVPool, KVPoolConfig
from raydix.workers.worker import TPWorker

from .conftest import TinyModel
from .driver import run_greedy, scenario
from .reference import assert_greedy_equal
from .tp_group import SpawnedTPGroup, TPCase, probe_plan

MODES = ("whole", "chunked", "prefix")


def _worker(m: TinyModel, **ds: object) -> TPWorker:
    return TPWorker(WorkerConfig(str(m.folder), dtype="float32", max_running_requests=8,
                                 max_context_len=256, max_total_tokens=4096, **ds))  # type: ignore[arg-type]


def test_budget_covering_the_context_gives_dense_tokens(tiny_models: dict[str, TinyModel]
                                                        ) -> None:
    m = tiny_models["llama"]  # GQA: two query heads per KV head
    ref = m.hf.greedy(m.prompts, 12)
    worker = _worker(m, kv_pool="double-sparse", ds_heavy_channel_num=4,
                     ds_heavy_token_num=256, ds_sparse_decode_threshold=0)
    assert isinstance(worker.runner.backend, DoubleSparseBackend)

    def logits(seqs: list[list[int]]) -> list[np.ndarray]:
        return list(worker.runner.forward(probe_plan(seqs, 1)).float().numpy())

    for mode in MODES:
        out = run_greedy(worker.step, scenario(mode, m.prompts, 12))
        assert_greedy_equal(out, ref, m.prompts, m.hf, logits, f"double-sparse {mode}")


def _decode_batch(seq_lens: list[int], slots: torch.Tensor) -> ForwardBatch:
    num = len(seq_lens)
    return ForwardBatch(np.arange(num), np.array(seq_lens) - 1, np.ones(num, np.int64),
                        torch.zeros(num, dtype=torch.long),
                        torch.tensor(seq_lens) - 1, slots)


def test_small_budget_attends_exactly_over_the_best_scored_tokens() -> None:
    torch.manual_seed(0)
    hk, group, dim, budget, channels = 2, 3, 16, 5, 4
    lens = [12, 9]
    pool = DoubleSparseKVPool(KVPoolConfig(32, 1, 1, hk, dim, torch.float32), "cpu", channels)
    pool.heavy_channels[0] = torch.stack([torch.randperm(dim)[:channels] for _ in range(hk)])
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[0, :12] = torch.arange(1, 13)
    table[1, :9] = torch.arange(13, 22)
    for r, n in enumerate(lens):  # fill the context through set_kv, so labels are written too
        slots = table[r, : n - 1].long()
        pool.set_kv(0, slots, torch.randn(n - 1, hk, dim), torch.randn(n - 1, hk, dim))
    backend = DoubleSparseBackend(pool, table, hk * group, dim, None, budget, 0)
    backend.prepare(_decode_batch(lens, torch.tensor([12, 21])))
    q, k, v = torch.randn(2, hk * group, dim), torch.randn(2, hk, dim), torch.randn(2, hk, dim)
    out = backend.forward(0, q, k, v).view(2, hk, group, dim)
    for r, n in enumerate(lens):  # reference: score on the labels, keep `budget`, attend densely
        slots = table[r, :n].long()
        keys, values = pool.k_buffers[0][slots], pool.v_buffers[0][slots]  # [n, Hk, D]
        for h in range(hk):
            ch = pool.heavy_channels[0, h]
            for g in range(group):
                qh = q[r, h * group + g]
                kept = (keys[:, h, ch] @ qh[ch]).topk(budget).indices
                probs = torch.softmax(keys[kept, h] @ qh * dim ** -0.5, dim=0)
                torch.testing.assert_close(out[r, h, g], probs @ values[kept, h],
                                           atol=1e-5, rtol=1e-5)
                dense = torch.softmax(keys[:, h] @ qh * dim ** -0.5, dim=0) @ values[:, h]
                assert not torch.allclose(out[r, h, g], dense, atol=1e-4)  # really sparse


def test_heavy_channels_from_calibration_and_from_a_file(tiny_models: dict[str, TinyModel],
                                                         tmp_path: Path) -> None:
    m = tiny_models["llama"]
    calibrated = _worker(m, kv_pool="double-sparse", ds_heavy_channel_num=4)
    channels = calibrated.runner.kv_pool.heavy_channels  # type: ignore[union-attr]
    assert channels.shape == (2, 2, 4)  # layers, KV heads, channels
    assert all(len(set(row.tolist())) == 4 for row in channels.reshape(-1, 4))
    assert not bool(calibrated.runner.req_to_token[0].any())  # the calibration row is given back
    pool = calibrated.runner.kv_pool
    expected_bytes = (4096 + 1) * 2 * 2 * (16 + 16 + 4) * 4  # slots, layers, heads, K+V+label
    assert pool.num_bytes == expected_bytes
    reversed_file = {f"model.layers.{i}.self_attn.k_proj":
                     [row.tolist()[::-1] + [0] for row in channels[i]] for i in range(2)}
    path = tmp_path / "channels.json"
    path.write_text(json.dumps(reversed_file))
    from_file = _worker(m, kv_pool="double-sparse", ds_heavy_channel_num=4,
                        ds_channel_config=str(path))
    # the file's first four channels per head, in the file's order
    assert torch.equal(from_file.runner.kv_pool.heavy_channels,  # type: ignore[union-attr]
                       channels.flip(-1))


def test_tp2_sparse_path_gives_dense_tokens(tiny_models: dict[str, TinyModel],
                                            tp2_group: SpawnedTPGroup) -> None:
    """Each rank calibrates and scores its own KV heads (llama: one of two per rank)."""
    m = tiny_models["llama"]
    ref = m.hf.greedy(m.prompts, 12)
    options = (("kv_pool", "double-sparse"), ("ds_heavy_channel_num", 4),
               ("ds_heavy_token_num", 256), ("ds_sparse_decode_threshold", 0))
    tp2 = tp2_group.run(TPCase(str(m.folder), m.prompts, 12, MODES, worker_options=options))
    assert tp2.shard_shapes["kv_pool"][1] == 1  # one KV head on rank 0
    for mode in MODES:
        assert_greedy_equal(tp2.outputs[mode], ref, m.prompts, m.hf,
                            lambda s: tp2_group.run(TPCase(str(m.folder), [], 0, (), s,
                                                           worker_options=options))
                            .probe_logits, f"double-sparse tp=2 {mode}")
