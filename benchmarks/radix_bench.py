"""Radix prefix cache speed on a shared-prefix trace, beside a plain list-based baseline.

Trace: 64 groups x 16 prompts, each a 2048-token group prefix plus a 128-token question,
random token ids, shuffled. Each request is matched, then inserted (as a finished request is).
Then 100k tokens are evicted from the full tree. Token ids are int32 numpy arrays, as the
scheduler keeps them. Prints the hit rate, microseconds per match_prefix and per insert, and
milliseconds per 100k evicted tokens, with the ratio to the targets and to the baseline.

    python benchmarks/radix_bench.py [--page-size 1] [--groups 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _list_radix import ListRadixCache

from raydix.cache import RadixCache

Key = np.ndarray | list[int]

TARGET_MATCH_US = 5.0
TARGET_INSERT_US = 15.0
TARGET_EVICT_MS = 5.0


def make_trace(
    groups: int, per_group: int, prefix_len: int, question_len: int, seed: int
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 50_000, size=(groups, prefix_len), dtype=np.int32)
    trace = [
        np.concatenate((prefixes[g], rng.integers(0, 50_000, size=question_len, dtype=np.int32)))
        for g in range(groups)
        for _ in range(per_group)
    ]
    order = rng.permutation(len(trace))
    return [trace[i] for i in order]


def _time_trace(
    keys: Sequence[Key],
    match_len: Callable[[Key], int],
    insert: Callable[[Key, int], None],
    evict: Callable[[int], int],
) -> dict[str, float]:
    """Match then insert every request (slots from a running counter), then evict 100k."""
    match_ns, insert_ns = [], []
    hit = total = 0
    next_slot = 16
    for key in keys:
        t0 = time.perf_counter_ns()
        hit += match_len(key)
        t1 = time.perf_counter_ns()
        insert(key, next_slot)
        t2 = time.perf_counter_ns()
        next_slot += len(key)
        match_ns.append(t1 - t0)
        insert_ns.append(t2 - t1)
        total += len(key)
    t0 = time.perf_counter_ns()
    evicted = evict(100_000)
    evict_ns = time.perf_counter_ns() - t0
    return {
        "hit_rate": hit / total,
        "match_us": statistics.mean(match_ns) / 1e3,
        "insert_us": statistics.mean(insert_ns) / 1e3,
        "match_p50_us": statistics.median(match_ns) / 1e3,
        "insert_p50_us": statistics.median(insert_ns) / 1e3,
        "evict_ms_per_100k": evict_ns / 1e6 * 100_000 / evicted,
    }


def run_raydix(trace: list[np.ndarray], page_size: int) -> dict[str, float]:
    cache = RadixCache(page_size=page_size)
    slot_ids = np.arange(16, 16 + sum(map(len, trace)), dtype=np.int32)  # made before timing
    return _time_trace(
        trace,
        lambda key: cache.match_prefix(key).cached_len,
        lambda key, first: cache.insert(key, slot_ids[first - 16 : first - 16 + len(key)]),
        lambda num: len(cache.evict(num)),
    )


def run_baseline(trace: list[np.ndarray], page_size: int) -> dict[str, float]:
    cache = ListRadixCache(page_size=page_size)
    slot_ids = list(range(16, 16 + sum(map(len, trace))))
    return _time_trace(
        [tokens.tolist() for tokens in trace],
        lambda key: len(cache.match_prefix(key)),
        lambda key, first: cache.insert(key, slot_ids[first - 16 : first - 16 + len(key)]),
        cache.evict,
    )


def best_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: min(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs per system; best is kept")
    args = parser.parse_args()

    trace = make_trace(args.groups, args.per_group, args.prefix_len, args.question_len, seed=0)
    print(
        f"trace: {len(trace)} requests of {len(trace[0])} tokens "
        f"({args.groups} groups x {args.per_group}), shuffled"
    )
    for page_size in args.page_size:
        ours = best_of([run_raydix(trace, page_size) for _ in range(args.repeats)])
        base = best_of([run_baseline(trace, page_size) for _ in range(args.repeats)])
        assert abs(ours["hit_rate"] - base["hit_rate"]) < 1e-12, "hit rates differ"
        print(f"\npage_size={page_size}   hit rate {ours['hit_rate']:.4f}")
        print(f"{'':22}{'raydix':>10}{'baseline':>12}{'speed-up':>10}{'target':>9}{'ok':>5}")
        rows = [
            ("match_prefix (us)", "match_us", TARGET_MATCH_US),
            ("  median", "match_p50_us", TARGET_MATCH_US),
            ("insert (us)", "insert_us", TARGET_INSERT_US),
            ("  median", "insert_p50_us", TARGET_INSERT_US),
            ("evict 100k tok (ms)", "evict_ms_per_100k", TARGET_EVICT_MS),
        ]
        for label, key, target in rows:
            ok = "yes" if ours[key] <= target else "NO"
            print(
                f"{label:22}{ours[key]:10.2f}{base[key]:12.2f}{base[key] / ours[key]:9.1f}x"
                f"{target:9.1f}{ok:>5}"
            )


if __name__ == "__main__":
    main()
