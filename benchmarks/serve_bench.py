"""What serving through `raydix serve` costs over the engine in-process, in one run.

The same prompts (random token ids, greedy, `ignore_eos`, a fixed output length) run through
the in-process engine (the config `raydix serve` would build, one rank in this process) and
through `raydix serve` started as a user starts it, over HTTP streams. For each number of
concurrent streams it reports time to first token, time per output token (after the first)
and output throughput on both paths, and the added TTFT, added time per token and the
throughput ratio serve / in-process.

Each `--variant` is one `raydix serve` run with those extra flags (e.g. "--cpu-threads 1" and
"--cpu-threads 2"; `NAME=value` words set environment variables of that run), all measured against the same in-process baseline; `--threads` lists the
in-process thread counts tried, and the best in-process figure is the baseline.

On a shared machine the figures move with the other work, so each variant runs `--repeats`
rounds, and on the CPU a round runs every load in-process and then through the server (both
paths see the same minutes); the best figure of each path over the rounds is kept, and beside
the ratio of the bests the median over the rounds of each round's own ratio (a quiet minute
that only one path met moves it less). On a GPU,
which holds one engine's KV pool, the in-process rounds run first and free the GPU. Beside the wall-clock
figures it reports what the load cost in CPU time per output token, per process of the server
(the engine replica, the ingress, Serve's proxy, ...) and for the in-process engine: a figure
that moves far less with the other work than the wall clock does. And where the server's
time to the first token goes: its own split (`/metrics`), the engine replica's part (from the
replica receiving a request to its first output) against the rest (the ingress, the routing
decision, the calls between the processes).

    python benchmarks/serve_bench.py [--model default|tiny|PATH] [--streams 1 16 64]
        [--prompt-len 128] [--output-len 128] [--threads 1 2] [--variant "--cpu-threads 2" ...]
        [--serve-args "--max-total-tokens 100000"] [--repeats 3] [--json out.json]

`tiny` is a random 2-layer Llama (hidden 64) with the default model's tokenizer: its step is
nearly all host work, the CPU's stand-in for a GPU step when measuring the serving path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from _serve_process import MODEL_NAME, cpu_per_token, process_tree_cpu, start_server, stop_server
from _serve_stats import SeedSource, Stats, best_of, prompts_for, summarize

from raydix.deploy.config import AppConfig, resolve_model_path
from raydix.deploy.engine_settings import engine_config
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams


# ------------------------------------------------------------------------------ in-process
def run_engine(engine: Engine, prompts: list[list[int]], output_len: int) -> Stats:
    params = GenerationParams(max_new_tokens=output_len, ignore_eos=True)
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        times[engine.add_request(p, params, f"r{i}")] = []
    while engine.has_work:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.rid] += [now] * len(out.new_token_ids)
    return summarize(start, list(times.values()))


class InProcess:
    """The engine `raydix serve` would build, in this process (one rank), kept across rounds."""

    def __init__(self, config: AppConfig, model_path: str, device: str) -> None:
        from transformers import AutoTokenizer

        self.engine = Engine(engine_config(config, model_path, device),  # detokenizes, as the
                             tokenizer=AutoTokenizer.from_pretrained(model_path))  # server
        self.vocab = _vocab(model_path)
        self.device = device
        self.warm: set[int] = set()

    def run(self, streams: list[int], prompt_len: int, output_len: int, threads: list[int],
            seeds: SeedSource) -> dict[int, Stats]:
        """The best (highest throughput) figure over the thread counts, per load."""
        best: dict[int, Stats] = {}
        for n_threads in threads if self.device == "cpu" else [torch.get_num_threads()]:
            torch.set_num_threads(n_threads)
            if n_threads not in self.warm:  # every batch size measured, at this thread count:
                self.warm.add(n_threads)  # a graph's guards see the threads (cpu_decode_graph.py)
                for n in sorted({1, 2, *streams}):
                    run_engine(self.engine, prompts_for(n, prompt_len, self.vocab, seeds()), 4)
            for n in streams:  # prompts new to this engine's prefix cache on every pass
                prompts = prompts_for(n, prompt_len, self.vocab, seeds())
                cpu = time.process_time()
                stats = run_engine(self.engine, prompts, output_len)
                cpu_ms = (time.process_time() - cpu) * 1e3 / (n * output_len)
                stats = stats._replace(cpu_ms_per_token={"in-process": cpu_ms})
                print(f"  in-process, {n_threads} thread(s), {n:3d} streams: "
                      f"{stats.throughput:8.1f} tok/s, TTFT {stats.ttft_s * 1e3:8.1f} ms, "
                      f"TPOT {stats.tpot_s * 1e3:6.1f} ms, CPU {cpu_ms:.2f} ms/token", flush=True)
                if n not in best or stats.throughput > best[n].throughput:
                    best[n] = stats
        return best

    def shutdown(self) -> None:
        self.engine.shutdown()


def _vocab(model_path: str) -> int:
    return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])


# ----------------------------------------------------------------------------- through serve
async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int],
                  output_len: int) -> list[float]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


# A burst started right after a /metrics scrape ran slower (tiny model, 64 streams: 0.31-0.35 of
# in-process against 0.39-0.41 without the scrape, and 0.39-0.40 with this pause between them).
# The engine replica's stats report, which the scrape sets off, is what slows it: with the
# replica's reporter off, bursts after a scrape ran as fast as the others (cause inside not found)
SCRAPE_SETTLE_S = 2.0


def ttft_parts(url: str) -> dict[str, float]:
    """The server's split of the time to the first token, summed over its requests so far: the
    engine replica's part and the rest (`raydix_{engine,path}_time_to_first_token_seconds`)."""
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return {f"{part}_{suffix}": sum(float(line.split()[-1]) for line in lines
                                    if line.split()[:1] == [
                                        f"raydix_{part}_time_to_first_token_seconds_{suffix}"])
            for part in ("engine", "path") for suffix in ("sum", "count")}


def through_serve(server: subprocess.Popen[bytes], url: str, streams: list[int],
                  prompt_len: int, output_len: int, vocab: int,
                  seeds: SeedSource) -> dict[int, Stats]:
    async def burst(n: int, seed: int, length: int) -> Stats:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as c:
            start = time.perf_counter()
            times = await asyncio.gather(*(_stream(c, url, p, length)
                                           for p in prompts_for(n, prompt_len, vocab, seed)))
        # chunks, not tokens: spread the output tokens evenly from the first chunk on
        token_times = [list(np.linspace(t[0], t[-1], length)) if len(t) > 1 else t for t in times]
        stats = summarize(start, token_times)
        gaps = [float(np.max(np.diff(t))) for t in times if len(t) > 1]
        return stats._replace(max_gap_s=max(gaps, default=0.0))

    for n in sorted({2, *streams}):  # warm-up: each load once
        asyncio.run(burst(n, seeds(), 4))
    out = {}
    for n in streams:
        parts = ttft_parts(url)
        time.sleep(SCRAPE_SETTLE_S)
        before, client = process_tree_cpu(server.pid), time.process_time()
        stats = asyncio.run(burst(n, seeds(), output_len))
        cpu = cpu_per_token(before, process_tree_cpu(server.pid), n * output_len)
        parts = {k: v - parts[k] for k, v in ttft_parts(url).items()}
        cpu["client (this script)"] = (time.process_time() - client) * 1e3 / (n * output_len)
        out[n] = stats = stats._replace(cpu_ms_per_token=cpu)
        print(f"  serve, {n:3d} streams: {stats.throughput:8.1f} tok/s, "
              f"TTFT {stats.ttft_s * 1e3:8.1f} ms, TPOT {stats.tpot_s * 1e3:6.1f} ms, "
              f"longest gap {stats.max_gap_s * 1e3:7.1f} ms", flush=True)
        print("    CPU ms/token: " + ", ".join(f"{role} {ms:.2f}" for role, ms in cpu.items()
                                                if ms >= 0.01), flush=True)
        if parts["engine_count"]:
            print(f"    TTFT, the server's split (means): in the engine replica "
                  f"{parts['engine_sum'] / parts['engine_count'] * 1e3:.1f} ms, outside it "
                  f"{parts['path_sum'] / parts['path_count'] * 1e3:.1f} ms", flush=True)
    return out


# ------------------------------------------------------------------------------------- main
def tiny_model(folder: Path, tokenizer_from: str) -> str:
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, initializer_range=0.3, eos_token_id=2,
                         bos_token_id=1, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (Path(tokenizer_from) / name).is_file():
            shutil.copy(Path(tokenizer_from) / name, folder / name)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default, tiny, or a local folder")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="in-process torch threads tried (CPU); the best is the baseline")
    parser.add_argument("--serve-args", default="", help="flags for every raydix serve run, "
                        "also applied to the in-process engine's config where they name one")
    parser.add_argument("--variant", action="append", default=None,
                        help="extra flags of one raydix serve run (repeat for several)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of (in-process, then serve) per variant; the best is kept")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    common = shlex.split(args.serve_args)
    variants = args.variant or [""]
    seeds = SeedSource()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":  # the default model's tokenizer (its package must be installed)
            model = tiny_model(Path(tmp) / "tiny", resolve_model_path(AppConfig()))
        from raydix.deploy.cli import build_parser, load_config

        config = load_config(build_parser().parse_args(["serve", "--model", model, *common]))
        model_path = resolve_model_path(config)
        device = "cuda" if torch.cuda.is_available() and config.device != "cpu" else "cpu"
        print(f"model {args.model}, device {device}, prompts {args.prompt_len} tokens, "
              f"{args.output_len} output tokens, streams {args.streams}, cores {os.cpu_count()}, "
              f"{args.repeats} round(s)")
        engine: InProcess | None = InProcess(config, model_path, device)
        vocab = _vocab(model_path)
        base: dict[int, Stats] = {}

        def in_process_round() -> dict[int, Stats]:
            nonlocal base
            assert engine is not None
            this_round = engine.run(args.streams, args.prompt_len, args.output_len,
                                    args.threads, seeds)
            base = best_of(base, this_round)
            return this_round

        if device == "cuda":  # a GPU holds one engine's KV pool: the in-process rounds first
            for r in range(args.repeats):
                print(f" in-process round {r + 1}:", flush=True)
                in_process_round()
            engine.shutdown()
            engine = None
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        results: dict[str, dict[int, Stats]] = {}
        # CPU: serve / in-process of each round (both paths in the same minutes)
        paired: dict[str, dict[int, list[float]]] = {}
        try:
            for variant in variants:
                print(f"raydix serve {args.serve_args} {variant}:", flush=True)
                proc, url = start_server(model, common + shlex.split(variant), Path(tmp) / "log")
                try:
                    for r in range(args.repeats):
                        print(f" round {r + 1}:", flush=True)
                        in_round = in_process_round() if engine is not None else {}
                        served = through_serve(proc, url, args.streams, args.prompt_len,
                                               args.output_len, vocab, seeds)
                        results[variant] = best_of(results.get(variant, {}), served)
                        for n, stats in in_round.items():  # the CPU: the same minutes
                            paired.setdefault(variant, {}).setdefault(n, []).append(
                                served[n].throughput / stats.throughput)
                finally:
                    stop_server(proc)
        finally:
            if engine is not None:
                engine.shutdown()

    print("\n| serve flags | streams | in-process tok/s | serve tok/s | ratio | "
          "ratio, median of rounds | added TTFT | added time/token | longest gap | "
          "CPU ms/token in-process | serve (largest) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for variant, by_streams in results.items():
        for n, s in sorted(by_streams.items()):
            b = base[n]
            cpu = s.cpu_ms_per_token or {}
            total = sum(ms for role, ms in cpu.items() if not role.startswith("client"))
            top = ", ".join(f"{role} {ms:.2f}" for role, ms in list(cpu.items())[:3])
            rounds = paired.get(variant, {}).get(n)
            median = f"{float(np.median(rounds)):.2f}" if rounds else "-"
            print(f"| `{(args.serve_args + ' ' + variant).strip() or '(defaults)'}` | {n} | "
                  f"{b.throughput:.1f} | {s.throughput:.1f} | {s.throughput / b.throughput:.2f} | "
                  f"{median} | "
                  f"{(s.ttft_s - b.ttft_s) * 1e3:+.1f} ms | {(s.tpot_s - b.tpot_s) * 1e3:+.2f} ms "
                  f"| {s.max_gap_s * 1e3:.0f} ms | {(b.cpu_ms_per_token or {}).get('in-process', 0):.2f} "
                  f"| {total:.2f} ({top}) |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "base": {n: s._asdict() for n, s in base.items()},
            "serve": {v: {n: s._asdict() for n, s in r.items()} for v, r in results.items()},
            "paired_ratios": paired},
            indent=2))


if __name__ == "__main__":
    main()
