"""Router speed and quality.

Decision latency (in-process): a global tree holding 10M cached tokens from 16 replicas
(256 groups of a 2,048-token prefix, each with 128-token questions, spread over the replicas);
prints p50 and p99 of one routing decision (tree match + policy), target p99 <= 200 us.

    python benchmarks/router_bench.py decision [--tokens 10000000] [--replicas 16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raydix.router.state import RouterState

TARGET_P99_US = 200.0


def decision_latency(num_tokens: int, num_replicas: int, page_size: int, queries: int) -> None:
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
        state.report_load(name, i % 5, i % 3, 0.5, 0)
    lat = []
    for i in range(queries):
        prompt = np.concatenate((prefixes[i % 256], rng.integers(0, 50_000, 64, dtype=np.int32)))
        t0 = time.perf_counter_ns()
        state.route(prompt)
        lat.append(time.perf_counter_ns() - t0)
    us = np.array(lat) / 1e3
    p99 = float(np.percentile(us, 99))
    print(f"decision: p50 {np.median(us):.1f} us, p99 {p99:.1f} us, mean {us.mean():.1f} us "
          f"(target p99 <= {TARGET_P99_US:.0f} us: {'yes' if p99 <= TARGET_P99_US else 'NO'}, "
          f"{TARGET_P99_US / p99:.1f}x under)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    dec = sub.add_parser("decision", help="in-process decision latency")
    dec.add_argument("--tokens", type=int, default=10_000_000)
    dec.add_argument("--replicas", type=int, default=16)
    dec.add_argument("--page-size", type=int, default=1)
    dec.add_argument("--queries", type=int, default=20_000)
    args = parser.parse_args()
    if args.what == "decision":
        decision_latency(args.tokens, args.replicas, args.page_size, args.queries)


if __name__ == "__main__":
    main()
