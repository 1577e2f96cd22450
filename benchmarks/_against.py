"""`engine_bench.py --against REV`: the same workloads on this checkout and on a second checkout
of REV, in the same run, alternating, each in a fresh process; prints new/REV ratios.

REV is checked out with `git worktree add --detach` under the system temp folder (kept for the
next run), and imported through a folder of links that maps `raydix.<x>` onto its `<x>/` folders,
so the same venv runs both. Workloads (random token ids, the default model, CPU):

- one stream: a 128-token prompt, 128 new tokens (output tokens/s);
- two streams, four streams: two or four such prompts side by side (decode steps of two or
  four requests);
- lone prompt: TTFT of one 512-token prompt (seconds, lower is better);
- shared prefix: 4x4 prompts of a 512-token group prefix + 64, 32 new tokens each, cache on;
- mixed: 16 prompts of 32-512 tokens, 16-128 new tokens each;
- KV tokens: the pool the default 2 GiB CPU budget leaves for the KV cache, under the
  workers' default step budget (8,192 prompt tokens a step sized into the activations' room);
- KV tokens (serve): the same under the config `raydix serve` builds on CPU (its own step
  budget, `deploy/config.py`), which is what a user of `make serve` gets.

A checkout with `workers/huge_pages.py` runs its children with glibc's malloc on 2 MiB pages, as
its `raydix serve` starts the engine process on CPU.

A checkout whose workers have the CPU decode graph (`cpu_decode_graph.py`) runs with it, and
with the CPU step graph (`cpu_step_graph.py`) where it has that too, as `raydix serve` does on
CPU, unless `--no-decode-graph` is given (then with neither).

Throughputs and the TTFT are given twice: in wall-clock time, and in the child's own CPU time
(`time.process_time`). With one torch thread the two agree on an idle machine; on a shared one
the CPU time is the steadier of the two (a busy neighbour delays the child without charging it
CPU time), so both ratios are printed.

    python benchmarks/engine_bench.py --against 69dc4c0 [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from raydix.workers.huge_pages import malloc_env

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("cache", "workers", "engine", "cluster", "router", "deploy")  # those REV has
WORKLOADS = ("one stream", "two streams", "four streams", "lone prompt", "shared prefix", "mixed",
             "KV tokens", "KV tokens (serve)")
KV_ROWS = {"KV tokens", "KV tokens (serve)"}
LOWER_IS_BETTER = {"lone prompt"}
DECODE_GRAPH_ENV = "RAYDIX_BENCH_DECODE_GRAPH"  # "0": the children run without it


def checkout(rev: str) -> Path:
    """A worktree of `rev` (reused when it exists), and a folder whose `raydix` package maps
    onto it; returns that folder, for PYTHONPATH."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    base = Path(tempfile.gettempdir()) / f"raydix-against-{sha}"
    tree = base / "tree"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha],
                       check=True, capture_output=True)
    pkg = base / "path" / "raydix"
    if not pkg.is_dir():
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").symlink_to(tree / "raydix" / "__init__.py")
        for sub in SUBPACKAGES:
            if (tree / sub).is_dir():  # engine/ was split out of cluster/
                (pkg / sub).symlink_to(tree / sub)
    return base / "path"


def run_side(path: Path | None, workload: str, threads: int, dtype: str) -> tuple[float, float]:
    """One workload in a fresh process, importing raydix from `path` (None: this checkout);
    returns its value in wall-clock time and in CPU time (the same for the KV rows)."""
    env = dict(os.environ)
    env.setdefault(DECODE_GRAPH_ENV, "1")
    if path is not None:
        env["PYTHONPATH"] = f"{path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if ((path / "raydix" if path is not None else REPO) / "workers" / "huge_pages.py").exists():
        # a checkout that starts its engine process with malloc on 2 MiB pages (as `raydix
        # serve` on CPU does) computes so here too
        env.update(malloc_env(env))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--child", workload, "--threads", str(threads),
                        "--dtype", dtype, "--out", out.name], check=True, env=env,
                       cwd=tempfile.gettempdir())
        found = json.loads(Path(out.name).read_text())
        return float(found["value"]), float(found["cpu_value"])


def compare(rev: str, rounds: int, threads: int, workloads: list[str], bf16: bool,
            new_dtype: str = "float32", base_dtype: str = "float32") -> None:
    path = checkout(rev)
    print(f"new: {REPO} (HEAD, {new_dtype})   baseline: {rev} ({base_dtype}) at "
          f"{path.parent / 'tree'}"
          f"   torch threads {threads}, {rounds} rounds alternating, each run in a fresh process")
    for workload in workloads:
        sides: dict[str, list[tuple[float, float]]] = {"base": [], "new": []}
        for _ in range(rounds):  # alternate, so that a busy spell hits both sides
            sides["base"].append(run_side(path, workload, threads, base_dtype))
            sides["new"].append(run_side(None, workload, threads, new_dtype))
        _print_rows(workload, sides)
    if bf16:
        sides = {"base": [], "new": []}  # base: the new fp32; new: the new bf16
        for _ in range(rounds):
            sides["base"].append(run_side(None, "one stream", threads, "float32"))
            sides["new"].append(run_side(None, "one stream", threads, "bfloat16"))
        _print_rows("one stream bf16 / new fp32", sides)


def _print_rows(name: str, sides: dict[str, list[tuple[float, float]]]) -> None:
    """The wall-clock row, and (except for the KV rows) the CPU-time row."""
    base, new = np.array(sides["base"]), np.array(sides["new"])  # [rounds, 2]
    clocks = ("",) if name in KV_ROWS else ("", " (CPU time)")
    for column, clock in enumerate(clocks):
        _print_row(name + clock, name, base[:, column], new[:, column])


def _print_row(label: str, name: str, base: np.ndarray, new: np.ndarray) -> None:
    ratios = new / base  # for a time (LOWER_IS_BETTER) below 1 is better
    unit = "s" if name in LOWER_IS_BETTER else ("tokens" if name in KV_ROWS else "tok/s")
    print(f"  {label:30} base {_fmt(base)} {unit:6} new {_fmt(new)} {unit:6} "
          f"new/base {ratios.min():.2f}-{ratios.max():.2f}x", flush=True)


def _fmt(values: np.ndarray) -> str:
    return "/".join(f"{v:.4g}" for v in values)


# ---- the child: one workload, in-process -------------------------------------------------


def requests(workload: str, vocab: int,
             rng: np.random.Generator) -> tuple[list[list[int]], list[int]]:
    """A workload's prompts (random token ids below `vocab`) and their output lengths."""
    if workload == "one stream":
        prompts, outputs = [rng.integers(100, vocab, size=128).tolist()], [128]
    elif workload in ("two streams", "four streams"):
        num = 2 if workload == "two streams" else 4
        prompts = [rng.integers(100, vocab, size=128).tolist() for _ in range(num)]
        outputs = [128] * num
    elif workload == "lone prompt":
        prompts, outputs = [rng.integers(100, vocab, size=512).tolist()], [1]
    elif workload == "shared prefix":
        prompts = []
        for _ in range(4):
            prefix = rng.integers(100, vocab, size=512).tolist()
            prompts += [prefix + rng.integers(100, vocab, size=64).tolist() for _ in range(4)]
        prompts = [prompts[i] for i in rng.permutation(len(prompts))]
        outputs = [32] * len(prompts)
    elif workload == "mixed":
        prompts = [rng.integers(100, vocab, size=int(rng.integers(32, 513))).tolist()
                   for _ in range(16)]
        outputs = [int(rng.integers(16, 129)) for _ in range(16)]
    else:
        raise ValueError(workload)
    return prompts, outputs


def drive(engine: Any, params: Any, prompts: list[list[int]],
          outputs: list[int]) -> tuple[tuple[float, float] | None, int, float, float]:
    """Add every request at once (`params`: the checkout's GenerationParams) and step the
    engine until all are done: (the first token's wall-clock and CPU time, the output tokens,
    wall-clock seconds, CPU seconds)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    first = None
    num_tokens = 0
    for p, n in zip(prompts, outputs, strict=True):
        engine.add_request(p, params(max_new_tokens=n, ignore_eos=True))
    while engine.has_work:
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = (time.perf_counter() - start, time.process_time() - cpu_start)
    return first, num_tokens, time.perf_counter() - start, time.process_time() - cpu_start


def _child(workload: str, threads: int, dtype: str) -> tuple[float, float]:
    import torch

    try:
        from raydix.engine.config import EngineConfig, SchedulerConfig
        from raydix.engine.engine import Engine
        from raydix.engine.request import GenerationParams
    except ImportError:  # a REV from before the engine core left cluster/
        from raydix.cluster.config import EngineConfig, SchedulerConfig  # type: ignore
        from raydix.cluster.engine import Engine  # type: ignore
        from raydix.cluster.request import GenerationParams  # type: ignore
    from raydix.workers.config import WorkerConfig
    from raydix.workers.gguf_convert import default_model_folder

    torch.set_num_threads(threads)
    folder = default_model_folder()
    graph = {field: True for field in ("cpu_decode_graph", "cpu_step_graph")
             if os.environ.get(DECODE_GRAPH_ENV) == "1"
             and field in WorkerConfig.__dataclass_fields__}
    if workload in KV_ROWS:
        from raydix.workers.runner import ModelRunner
        config = WorkerConfig(model_path=str(folder), dtype=dtype, **graph)
        if workload == "KV tokens (serve)":
            from raydix.deploy.config import AppConfig
            try:
                from raydix.deploy.engine_settings import engine_config
            except ImportError:  # a REV from before engine_settings left config.py
                from raydix.deploy.config import engine_config  # type: ignore
            config = engine_config(AppConfig(dtype=dtype), str(folder), "cpu").rank_config(0)
        tokens = ModelRunner(config).max_num_tokens
        return tokens, tokens
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    rng = np.random.default_rng(0)
    prompts, outputs = requests(workload, vocab, rng)
    worker = WorkerConfig(model_path=str(folder), dtype=dtype, max_total_tokens=40_000,
                          cpu_memory_budget_bytes=8 << 30, **graph)
    sched = SchedulerConfig(max_running_requests=64, max_context_len=2048,
                            enable_prefix_cache=True)
    engine = Engine(EngineConfig.build(worker, sched))
    warm = engine.add_request(rng.integers(100, vocab, size=16).tolist(),
                              GenerationParams(max_new_tokens=2, ignore_eos=True))
    while engine.has_work:  # first-call costs (oneDNN primitives) out of the timing
        engine.step()
    del warm
    first, num_tokens, seconds, cpu_seconds = drive(engine, GenerationParams, prompts, outputs)
    if workload == "lone prompt":
        assert first is not None
        return first
    return num_tokens / seconds, num_tokens / cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=WORKLOADS, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    value, cpu_value = _child(args.child, args.threads, args.dtype)
    Path(args.out).write_text(json.dumps({"value": value, "cpu_value": cpu_value}))


if __name__ == "__main__":
    main()
