"""The router bench's tables (markdown), ratios against the baselines, and text plots."""

from __future__ import annotations

Results = dict[str, dict[str, dict[str, float]]]  # router -> run ("zipf/open") -> metrics
OURS = "cache_aware"


def table(results: Results, run: str, ideal: float) -> str:
    rows = [f"| router | hit rate (ideal {ideal:.3f}) | output tok/s | TTFT mean | TTFT p90 | TTFT p99 "
            "| load spread | tok/step | wall |", "|---|---|---|---|---|---|---|---|---|"]
    for router, runs in results.items():
        if run not in runs:
            continue
        r = runs[run]
        rows.append(f"| {router} | {r['hit_rate']:.3f} | {r['throughput']:.1f} | "
                    f"{r['ttft_mean']:.2f} s | {r['ttft_p90']:.2f} s | {r['ttft_p99']:.2f} s | "
                    f"{r['spread']:.2f} | {r.get('tokens_per_step', 0.0):.2f} | {r['wall_s']:.0f} s |")
    return "\n".join(rows)


def ratios(results: Results, run: str, ideal: float) -> str:
    """cache_aware against each baseline: hit rate and throughput as ×, TTFT as × lower."""
    ours = results.get(OURS, {}).get(run)
    if ours is None:
        return ""
    lines = [f"{OURS} hit rate {ours['hit_rate']:.3f} = {ours['hit_rate'] / ideal:.0%} of ideal"]
    for router, runs in results.items():
        r = runs.get(run)
        if router == OURS or r is None:
            continue
        lines.append(
            f"{OURS} vs {router}: hit rate {ours['hit_rate'] / max(r['hit_rate'], 1e-9):.2f}x, "
            f"throughput {ours['throughput'] / r['throughput']:.2f}x, TTFT p90 "
            f"{r['ttft_p90'] / ours['ttft_p90']:.2f}x lower, p99 "
            f"{r['ttft_p99'] / ours['ttft_p99']:.2f}x lower")
    return "\n".join(lines)


def text_plot(results: Results, workload: str, width: int = 40) -> str:
    """Bars of TTFT p90 and throughput per router, for each arrival mode of one workload."""
    out = [f"{workload}: TTFT p90 (s, shorter is better) | output tok/s (longer is better)"]
    runs = sorted({run for runs in results.values() for run in runs
                   if run.startswith(workload + "/")})
    for run in runs:
        rows = [(router, r[run]) for router, r in results.items() if run in r]
        top_t = max(m["ttft_p90"] for _, m in rows) or 1.0
        top_x = max(m["throughput"] for _, m in rows) or 1.0
        out.append(f"-- {run.split('/', 1)[1]}")
        for router, m in rows:
            t = "#" * max(round(width * m["ttft_p90"] / top_t), 1)
            x = "=" * max(round(width / 2 * m["throughput"] / top_x), 1)
            out.append(f"{router:>14} {t:<{width}} {m['ttft_p90']:6.2f} | {x:<{width // 2}} "
                       f"{m['throughput']:5.1f}")
    return "\n".join(out)
