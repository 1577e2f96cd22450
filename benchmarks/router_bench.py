"""Router speed and quality.

Decision latency (in-process): a global tree holding 10M cached tokens from 16 replicas
(256 groups of a 2,048-token prefix, each with 128-token questions, spread over the replicas);
prints p50 and p99 of one routing decision (tree match + policy), target p99 <= 200 us. Each
decision stays in flight until `--in-flight` later decisions have been made, then the replica's
insert event confirms it (as replicas do after their prefill).

    python benchmarks/router_bench.py decision [--tokens 10000000] [--replicas 16]
        [--in-flight 64]

Serving (HTTP): the shared-prefix workload (16 groups x 16 prompts, a 512-token prefix per group,
64-token questions, 32 output tokens, shuffled) sent as token ids through the OpenAI API to N
replicas of the default model, once per router (cache_aware, round_robin, power_of_two). For each:
cache hit rate (usage cached_tokens / prompt_tokens), output throughput, mean and p99 time to
first token; then cache_aware's ratios to the others. It starts a local Ray (or joins
--address) and deploys each router's app in turn. `--quick` is a small smoke run for a laptop.

Each replica's KV pool holds `--kv-tokens` tokens (default 3,072): its share of the running
requests plus about four of the sixteen 512-token prefixes, so the prefixes in use (8,192 tokens)
are more than one replica holds and less than the four hold together. That is the regime a
cache-aware router is for: round robin makes every replica cache every group, and they evict
each other's work; cache-aware routing lets each replica keep its own groups. `--kv-tokens
100000` takes the pressure away (every replica holds everything) for comparison.

    python benchmarks/router_bench.py http [--replicas 4] [--concurrency 32 | --rate R]
        [--kv-tokens N] [--quick] [--plot benchmarks/router_policies.png] [--json out.json]

By default the load is a closed loop of `--concurrency` requests in flight, so all 32 first
requests (cold prefixes included) arrive at once. `--rate R` makes it an open loop instead:
Poisson arrivals at R requests/s, the same offered load for every router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx
import numpy as np

from raydix.router.state import RouterState

TARGET_P99_US = 200.0


def _confirm(state: RouterState, replica: str, prompt: np.ndarray) -> None:
    """What the replica's insert event does: the tree holds the prompt, the record ends."""
    state.tree.insert(replica, prompt[: len(prompt) // state.tree.page_size * state.tree.page_size])
    state.in_flight.confirm(replica, lambda t, k: state.tree.match(t, k).get(replica, 0))


def decision_latency(num_tokens: int, num_replicas: int, page_size: int, queries: int,
                     in_flight_depth: int) -> None:
    rng = np.random.default_rng(0)
    state = RouterState(page_size=page_size)
    replicas = [f"replica-{i}" for i in range(num_replicas)]
    state.set_replicas(replicas)
    prefixes = [rng.integers(0, 50_000, 2048, dtype=np.int32) for _ in range(256)]
    start = time.perf_counter()
    n = 0
    while state.tree.num_tokens < num_tokens:
        tokens = np.concatenate((prefixes[n % 256], rng.integers(0, 50_000, 128, dtype=np.int32)))
        state.tree.insert(replicas[n % num_replicas], tokens)
        n += 1
    print(f"tree: {state.tree.num_tokens:,} tokens from {n:,} requests over {num_replicas} "
          f"replicas (built in {time.perf_counter() - start:.1f} s)")
    for i, name in enumerate(replicas):
        state.report_load(name, i % 5, i % 3, 0.95 if i % 4 == 0 else 0.5)  # some saturated
    lat = []
    in_flight: list[tuple[str, np.ndarray]] = []
    for i in range(queries):
        prompt = np.concatenate((prefixes[i % 256], rng.integers(0, 50_000, 64, dtype=np.int32)))
        t0 = time.perf_counter_ns()
        decision = state.route(prompt)
        lat.append(time.perf_counter_ns() - t0)
        # the replica computes the prompt and reports it `in_flight_depth` decisions later
        in_flight.append((str(decision.replica), prompt))
        if len(in_flight) > in_flight_depth:
            _confirm(state, *in_flight.pop(0))
    us = np.array(lat) / 1e3
    p99 = float(np.percentile(us, 99))
    print(f"decision: p50 {np.median(us):.1f} us, p99 {p99:.1f} us, mean {us.mean():.1f} us "
          f"(target p99 <= {TARGET_P99_US:.0f} us: {'yes' if p99 <= TARGET_P99_US else 'NO'}, "
          f"{TARGET_P99_US / p99:.1f}x under)")


ROUTERS = ("cache_aware", "round_robin", "power_of_two")


def shared_prefix_prompts(groups: int, per_group: int, prefix_len: int, question_len: int,
                          seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(100, 40_000, prefix_len).tolist() for _ in range(groups)]
    prompts = [p + rng.integers(100, 40_000, question_len).tolist()
               for p in prefixes for _ in range(per_group)]
    return [prompts[i] for i in rng.permutation(len(prompts))]


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
                ) -> tuple[float, int, int, int]:
    """(time to first token, prompt tokens, cached tokens, output tokens) of one request."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = float("nan")
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft != ttft:
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return (ttft, int(usage.get("prompt_tokens", 0)),
            int(details.get("cached_tokens", 0)),  # type: ignore[union-attr]
            int(usage.get("completion_tokens", 0)))


async def run_workload(url: str, prompts: list[list[int]], max_tokens: int,
                       concurrency: int, rate: float | None = None) -> dict[str, float]:
    """Closed loop (`rate` None): `concurrency` requests in flight at all times. Open loop:
    requests arrive at `rate` per second (Poisson), whatever is in flight."""
    sem = asyncio.Semaphore(concurrency if rate is None else len(prompts))
    gaps = np.random.default_rng(7).exponential(1.0 / rate, len(prompts)) if rate else None
    async with httpx.AsyncClient(timeout=600) as client:

        async def limited(i: int, p: list[int]) -> tuple[float, int, int, int]:
            if gaps is not None:
                await asyncio.sleep(float(gaps[: i + 1].sum()))
            async with sem:
                return await _one(client, url, p, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    ttft = np.array([r[0] for r in results])
    prompt_tokens = sum(r[1] for r in results)
    return {"hit_rate": sum(r[2] for r in results) / max(prompt_tokens, 1),
            "throughput": sum(r[3] for r in results) / wall,
            "ttft_mean": float(np.nanmean(ttft)), "ttft_p99": float(np.nanpercentile(ttft, 99)),
            "wall_s": wall}


def http_compare(args: argparse.Namespace) -> None:
    import os

    import ray
    from ray import serve

    from raydix.deploy.app import build_app
    from raydix.deploy.config import AppConfig

    groups, per_group, prefix_len, question_len, max_tokens = 16, 16, 512, 64, 32
    if args.quick:
        groups, per_group, prefix_len, question_len, max_tokens = 4, 4, 128, 16, 4
    prompts = shared_prefix_prompts(groups, per_group, prefix_len, question_len)
    warmup = shared_prefix_prompts(args.replicas * 2, 1, 8, 8, seed=1)
    if args.address:
        ray.init(address=args.address)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.replicas + 1),
                 include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    results: dict[str, dict[str, float]] = {}
    try:
        for router in args.routers:
            # the README's tables were measured with the GPU's step budget; `--set
            # max_prefill_tokens=512 --set chunked_prefill_size=512` gives the CPU default
            options: dict[str, object] = {"max_prefill_tokens": 8192, "chunked_prefill_size": 2048}
            options.update(item.split("=", 1) for item in args.set)
            config = AppConfig(served_model_name="bench", replicas=args.replicas, router=router,
                               max_context_len=prefix_len + question_len + max_tokens + 8,
                               max_running_requests=args.concurrency,
                               max_total_tokens=args.kv_tokens, **options)
            serve.run(build_app(config), name="bench", route_prefix="/")
            asyncio.run(run_workload(url, warmup, 1, args.replicas))  # no prefix in common
            results[router] = asyncio.run(run_workload(url, prompts, max_tokens,
                                                       args.concurrency, args.rate))
            r = results[router]
            print(f"{router:>13}: hit rate {r['hit_rate']:.3f}, {r['throughput']:.1f} tok/s, "
                  f"TTFT mean {r['ttft_mean'] * 1e3:.0f} ms, p99 {r['ttft_p99'] * 1e3:.0f} ms "
                  f"({len(prompts)} requests in {r['wall_s']:.1f} s)", flush=True)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kv_tokens": args.kv_tokens, "replicas": args.replicas,
                       "results": results}, f, indent=2)
    if args.plot:
        load = f"{args.rate:g} req/s" if args.rate else f"{args.concurrency} in flight"
        plot(results, args.plot, f"{args.replicas} replicas, {groups}x{per_group} shared-prefix "
                                 f"requests, {load}, KV pool {args.kv_tokens:,} tokens each")
    if "cache_aware" not in results:
        return
    ca = results["cache_aware"]
    for other, r in results.items():
        if other == "cache_aware":
            continue
        print(f"cache_aware vs {other}: hit rate {ca['hit_rate'] / max(r['hit_rate'], 1e-9):.2f}x"
              f" (target >= 3), throughput {ca['throughput'] / r['throughput']:.2f}x (target "
              f">= 1.5), p99 TTFT {r['ttft_p99'] / ca['ttft_p99']:.2f}x lower (target >= 2)")


def plot(results: dict[str, dict[str, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    panels = (("hit_rate", "cache hit rate"), ("throughput", "output tokens / s"),
              ("ttft_p99", "p99 time to first token (s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.8))
    for ax, (key, label) in zip(axes, panels, strict=True):
        values = [results[n][key] for n in names]
        bars = ax.bar(names, values, color=["tab:green" if n == "cache_aware" else "tab:gray"
                                            for n in names])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    dec = sub.add_parser("decision", help="in-process decision latency")
    dec.add_argument("--tokens", type=int, default=10_000_000)
    dec.add_argument("--replicas", type=int, default=16)
    dec.add_argument("--page-size", type=int, default=1)
    dec.add_argument("--queries", type=int, default=20_000)
    dec.add_argument("--in-flight", type=int, default=64,
                     help="decisions routed but not yet confirmed by the replicas' events")
    http = sub.add_parser("http", help="the routers compared through HTTP")
    http.add_argument("--replicas", type=int, default=4)
    http.add_argument("--concurrency", type=int, default=32,
                      help="closed loop: requests in flight (and each replica's running cap)")
    http.add_argument("--rate", type=float,
                      help="open loop instead: requests arrive at this rate per second")
    http.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    http.add_argument("--port", type=int, default=8123)
    http.add_argument("--address", help="join this Ray cluster (default: a local Ray)")
    http.add_argument("--kv-tokens", type=int, default=3072,
                      help="KV pool tokens per replica (see the module docstring)")
    http.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                      help="an AppConfig option for every router run, e.g. "
                           "saturated_kv_usage=1 (repeatable)")
    http.add_argument("--plot", help="write a PNG of hit rate, throughput and p99 TTFT")
    http.add_argument("--json", help="write the results as JSON")
    http.add_argument("--quick", action="store_true",
                      help="4 groups x 4 prompts, 128-token prefixes, 4 output tokens")
    args = parser.parse_args()
    if args.what == "decision":
        decision_latency(args.tokens, args.replicas, args.page_size, args.queries,
                         args.in_flight)
    elif args.what == "http":
        http_compare(args)


if __name__ == "__main__":
    main()
