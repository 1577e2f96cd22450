"""`raydix serve`'s start-up time: from the command to its "raydix is ready" line.

Each start runs `raydix serve` with `make serve`'s defaults (the default model, CPU) as a user
does, waits for the ready line, reads the CPU time each process of the server used so far, and
stops it. The log's timestamps split the time into stages; the engine replica's own lines
(the model load, the compiled kernels, the warm-up) come from its start-up facts.

With `--against REV`, REV's checkout (made as `engine_bench.py --against` makes it) starts too,
alternating with this checkout, in the same minutes. Each side starts once more first, not
counted: inductor's on-disk cache keys on the source's path, so a new checkout's first start
compiles (issue 24 is about a restart, the cache warm).

    python benchmarks/startup_bench.py [--starts 3] [--against REV] [--port 8000]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from _against import checkout
from _serve_process import process_tree_cpu, stop_server

READY = "raydix is ready on"
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
# log lines that end a stage: (stage name, a piece of the line)
STAGES = (
    ("Ray started", "Started a local Ray instance"),
    ("Serve started", 'Started Serve in namespace'),
    ("engine replica added", "Adding 1 replica to Deployment(name='EngineServer'"),
    ("app running", "Application 'raydix' is ready"),
    ("ready line", READY),
)
FACTS = re.compile(r"replica \w+: (.*(?:started in|compiled in|loaded in|ready in|"
                   r"from its package in).*)")


def _stamp(line: str) -> float | None:
    found = STAMP.search(line)
    if found is None:
        return None
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def start_once(path: Path | None, port: int, log: Path) -> dict[str, object]:
    """One start: seconds to the ready line, stage end times, CPU seconds by role."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if path is not None:
        env["PYTHONPATH"] = f"{path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    argv = [sys.executable, "-m", "raydix.deploy.cli", "serve", "--port", str(port)]
    begin = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=tempfile.gettempdir(), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while READY not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"raydix serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.02)
        ready = time.time() - begin
        tick = os.sysconf("SC_CLK_TCK")
        cpu: dict[str, float] = {}
        for role, ticks in process_tree_cpu(proc.pid).values():
            cpu[role] = cpu.get(role, 0.0) + ticks / tick
    finally:
        stop_server(proc)
    text = log.read_text(errors="replace")
    stages: dict[str, float] = {}
    for name, piece in STAGES:
        for line in text.splitlines():
            stamp = _stamp(line)
            if piece in line and stamp is not None:
                stages[name] = stamp - begin
                break
    facts = [m.group(1) for m in FACTS.finditer(text)]
    return {"ready": ready, "stages": stages, "cpu": cpu, "facts": facts,
            "load": os.getloadavg()[0]}


def _report(side: str, result: dict[str, object]) -> None:
    stages = result["stages"]
    cpu = result["cpu"]
    assert isinstance(stages, dict) and isinstance(cpu, dict)
    print(f"{side:5} ready {result['ready']:5.1f} s (load {result['load']:.1f})  " +
          "  ".join(f"{k} {v:.1f}" for k, v in stages.items()), flush=True)
    top = sorted(cpu.items(), key=lambda kv: -kv[1])[:6]
    print("      CPU s: " + ", ".join(f"{role} {s:.1f}" for role, s in top), flush=True)
    for fact in result["facts"]:  # type: ignore[attr-defined]
        print(f"      {fact}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="counted starts per side")
    parser.add_argument("--against", help="a git revision to start alternately with this one")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-first-start", action="store_true",
                        help="count every start (the checkouts' caches are warm already)")
    args = parser.parse_args()
    sides: list[tuple[str, Path | None]] = [("new", None)]
    if args.against:
        sides.insert(0, ("base", checkout(args.against)))
    log = Path(tempfile.gettempdir()) / "raydix-startup-bench.log"
    readies: dict[str, list[float]] = {name: [] for name, _ in sides}
    for _, path in sides:  # not counted: each checkout's first start may compile
        if not args.no_first_start:
            start_once(path, args.port, log)
    for _ in range(args.starts):
        for name, path in sides:
            result = start_once(path, args.port, log)
            _report(name, result)
            readies[name].append(float(result["ready"]))  # type: ignore[arg-type]
    for name, values in readies.items():
        print(f"{name}: ready in " + " / ".join(f"{v:.1f}" for v in values) +
              f" s (best {min(values):.1f})")


if __name__ == "__main__":
    main()
