"""Ratios of two `gpu_bench.py --json` results: this checkout's against a baseline commit's, run
on the same card in one device call (`gpu_check.sh`'s `bench` and `against` steps).

    python benchmarks/gpu_ratios.py NEW.json BASELINE.json --baseline REV
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def ratio_rows(new: dict[str, Any], old: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(name, new, baseline, new / baseline) per workload's tok/s and per batch's step time
    (for a step, baseline / new: above 1 is faster too)."""
    rows = []
    old_tok = {w["workload"]: w["raydix_tok_s"] for w in old["workloads"]}
    for w in new["workloads"]:
        if w["workload"] in old_tok:
            a, b = w["raydix_tok_s"], old_tok[w["workload"]]
            rows.append((f"{w['workload']} tok/s", a, b, a / b))
    old_step = {s["batch"]: s["step_ms"] for s in old.get("step_split", [])}
    for s in new.get("step_split", []):
        if s["batch"] in old_step:
            a, b = s["step_ms"], old_step[s["batch"]]
            rows.append((f"batch-{s['batch']} step ms", a, b, b / a))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("new", type=Path)
    parser.add_argument("old", type=Path)
    parser.add_argument("--baseline", default="the baseline")
    args = parser.parse_args()
    new, old = (json.loads(p.read_text()) for p in (args.new, args.old))
    if new["facts"]["device"] != old["facts"]["device"]:
        raise SystemExit(f"different cards: {new['facts']['device']} and "
                         f"{old['facts']['device']}; compare runs of one card only")
    print(f"\n{new['facts']['device']}: this checkout against {args.baseline}\n")
    print("| measure | this checkout | baseline | speed-up |\n|---|---|---|---|")
    for name, a, b, r in ratio_rows(new, old):
        print(f"| {name} | {a:,.3f} | {b:,.3f} | {r:.2f}x |")


if __name__ == "__main__":
    main()
