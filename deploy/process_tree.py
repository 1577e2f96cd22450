"""The processes `raydix serve` started, and its wait for them to end (Linux `/proc`).

`ray.shutdown()` ends the local Ray instance by signalling its processes, and some of them end
a moment after it returns: the dashboard's module processes and workers each notice their
parent's end on their own. Under load a `raydix serve` that exited 0 still had three of them
alive. So the server lists every process below it before it shuts Ray down and returns only
once they have ended: those still alive after a grace period are killed (and named in the log),
so nothing it started outlives it. Elsewhere than Linux nothing is listed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

# pid -> (name, start time in clock ticks since boot): a pid reused by a later process has
# another start time
Processes = dict[int, tuple[str, int]]


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """(name, parent pid, start time) of a live process, None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    if rest[0] == "Z":  # ended, not yet reaped: holds nothing
        return None
    return name, int(rest[1]), int(rest[19])


def descendants(root: int) -> Processes:
    """Every live process below `root` (children, their children, ...)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    children: dict[int, list[int]] = {}
    facts: dict[int, tuple[str, int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            name, parent, start = stat
            children.setdefault(parent, []).append(int(entry.name))
            facts[int(entry.name)] = (name, start)
    found: Processes = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = facts[pid]
            todo += children.get(pid, ())
    return found


def alive(processes: Processes) -> Processes:
    """Those of `processes` still running (the same processes: same pid and start time)."""
    left: Processes = {}
    for pid, (name, start) in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == start:
            left[pid] = (name, start)
    return left


def end_all(processes: Processes, grace_s: float) -> list[str]:
    """Wait up to `grace_s` for `processes` to end, then kill those left; returns them, as
    "pid name"."""
    deadline = time.monotonic() + grace_s
    left = alive(processes)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = alive(left)
    for pid in left:
        with contextlib.suppress(OSError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while alive(left) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{pid} {name}" for pid, (name, _) in left.items()]
