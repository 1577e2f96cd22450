"""`raydix serve` as a process for the serving benchmarks (serve_bench.py, vllm_cpu_bench.py):
start it as a user does and wait for its ready line, stop it and everything it started, and
read the CPU time each process under it used."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MODEL_NAME = "bench"  # the name the server serves the model under


# --------------------------------------------------------------------- CPU time per process
def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _role(pid: int) -> str:
    """A server process's role: the Ray actor's name (ray::ServeReplica:raydix:EngineServer ->
    EngineServer) or the program's."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::"):
        name = first[5:].split(".")[0]
        return name.rsplit(":", 1)[-1] if name.startswith("ServeReplica") else name
    if "raydix.deploy.cli" in b" ".join(argv).decode(errors="replace"):
        return "raydix serve (driver)"
    return Path(first).name or "?"


def process_tree_cpu(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (role, CPU ticks so far) for `root` and every process under it."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), \
                    open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    out = {}
    for pid in tree:
        with contextlib.suppress(OSError, IndexError, ValueError):
            out[pid] = (_role(pid), _cpu_ticks(pid))
    return out


def cpu_per_token(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
                  num_tokens: int) -> dict[str, float]:
    """CPU ms per output token by role, largest first (processes alive at both ends)."""
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    by_role: dict[str, float] = {}
    for pid, (role, ticks) in after.items():
        if pid in before:
            by_role[role] = by_role.get(role, 0.0) + (ticks - before[pid][1]) * tick_ms
    return dict(sorted(((r, ms / num_tokens) for r, ms in by_role.items() if ms > 0),
                       key=lambda kv: -kv[1]))


def others_cpu_seconds() -> float:
    """CPU seconds that every process on the machine but this one (the benchmark's client) has
    used since boot (/proc/stat: user nice system irq softirq). Less a server's tree, what is
    left over a run is other work on a shared machine, which took cores from the server (a few
    seconds either way are the two counters' different accounting)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    own = os.times()
    busy = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    return busy - own.user - own.system


# ------------------------------------------------------------------------ the server process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_on_sigterm() -> None:
    """A time limit's SIGTERM (gpu_check.sh runs each step under `timeout`) ends this script
    through its `finally:` blocks, which stop the server: the server runs in a session of its
    own, and left running it holds the GPU that the next check needs."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def start_server(model: str, flags: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    _stop_on_sigterm()
    port = _free_port()
    env_vars = dict(f.split("=", 1) for f in flags if "=" in f and not f.startswith("-"))
    flags = [f for f in flags if "=" not in f or f.startswith("-")]
    argv = [sys.executable, "-m", "raydix.deploy.cli", "serve", "--model", model,
            "--served-model-name", MODEL_NAME, "--port", str(port), *flags]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", **env_vars}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while f"raydix is ready on http://127.0.0.1:{port}" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"raydix serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything of its session that outlived it
