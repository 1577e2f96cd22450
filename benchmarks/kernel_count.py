"""Kernels per decoder layer of a decode step, against the budget of 15.

CUDA: the runner as the GPU path builds it (bf16, flashinfer attention and fused ops, CUDA
graphs) on a ~1B Llama (random weights, TinyLlama-1.1B's shape); torch.profiler records one
replay of the batch-1 and batch-64 decode graphs, and the CUDA kernels it launched are divided
by the number of layers (the embedding, final norm and head are spread over the layers too, so
this slightly overstates a layer). Also the operator census of one eager decode forward
(workers/op_census.py), per layer.

CPU: the operator census only, with the fused ops' CPU kernels, on the same layer shape (two
layers). Attention there is the torch backend's, counted operator by operator: the budget is
asserted on the CPU by tests/workers/test_kernel_count.py, with the flashinfer backend's own
forward.

    python benchmarks/kernel_count.py [--synthetic-root /tmp/raydix-bench] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from worker_bench import SYNTHETIC, OurEngine, synthetic_model

from raydix.workers.config import WorkerConfig
from raydix.workers.layers.fused import fused_ops_for
from raydix.workers.op_census import describe, op_census
from raydix.workers.runner import ModelRunner

BUDGET = 15


def _runner(folder: Path, cuda: bool, max_batch: int) -> ModelRunner:
    if cuda:
        return ModelRunner(WorkerConfig(
            str(folder), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
            cuda_graph=True, cuda_graph_max_batch=max_batch, max_running_requests=max_batch,
            max_context_len=256, max_total_tokens=100_000))
    return ModelRunner(WorkerConfig(str(folder), dtype="bfloat16", max_running_requests=max_batch,
                                    max_context_len=256, max_total_tokens=20_000,
                                    cpu_packed_linear=False,  # the GEMMs as on CUDA
                                    cpu_compiled_attention=False))  # no dispatch mode in it


def census_per_layer(runner: ModelRunner, engine: OurEngine, batch: int) -> list[int]:
    """Operators each layer dispatches in one eager decode forward of `batch` requests."""
    from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan

    reqs = [ScheduledRequest(i, engine._lens[i], [5], [engine._next_slot + i], GREEDY)
            for i in range(batch)]
    plan = StepPlan.build(10_000, reqs)
    runner.table.apply(plan)
    fb = runner._make_batch(plan)
    runner.backend.prepare(fb)
    with torch.inference_mode(), op_census(runner.model.model.layers) as census:
        runner.model(fb.input_ids, fb.positions, runner.backend)
    print(describe(census).splitlines()[2], flush=True)
    return census.per_layer()


def graph_kernels(runner: ModelRunner, batch: int) -> int:
    """CUDA kernels one replay of the batch's decode graph launches."""
    from torch.profiler import ProfilerActivity, profile

    graphs = runner.graph_runner
    assert graphs is not None
    bs = min(s for s in graphs.batch_sizes if s >= batch)
    graphs.graphs[bs].replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.graphs[bs].replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA"
               and not e.name.startswith(("Memcpy", "Memset")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic-root", type=Path, default=Path("/tmp/raydix-bench"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:  # the same layer on the CPU, fewer of them and a smaller vocabulary
        SYNTHETIC["llama-1b-cpu"] = dict(SYNTHETIC["llama-1b"], num_hidden_layers=2,
                                         vocab_size=1000)
    folder = synthetic_model("llama-1b" if cuda else "llama-1b-cpu", args.synthetic_root)
    rows: list[dict[str, object]] = []
    for batch in (1, 64):
        runner = _runner(folder, cuda, 64)
        if not cuda:  # the CUDA path's selection, through the operators' CPU kernels
            runner.model.use_fused_ops(fused_ops_for("fused"))
            runner.kv_pool.ops = runner.model.fused_ops  # type: ignore[union-attr]
        layers = runner.model_config.num_layers
        engine = OurEngine(runner)
        prompts = np.random.default_rng(0).integers(100, 900, (batch, 16)).tolist()
        engine.decode(engine.prefill(prompts), 2)  # warm: kernels compiled, tables filled
        row: dict[str, object] = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                                  "batch": batch, "fused_ops": runner.model.fused_ops.name,
                                  "ops_per_layer": census_per_layer(runner, engine, batch)}
        if cuda:
            kernels = graph_kernels(runner, batch)
            row.update(graph_kernels=kernels, kernels_per_layer=round(kernels / layers, 2))
            print(f"batch {batch}: {kernels} kernels per decode graph replay, "
                  f"{kernels / layers:.1f} per layer (budget {BUDGET})", flush=True)
        rows.append(row)
        del runner
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
