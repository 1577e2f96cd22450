"""`raydix serve`'s wait for what it started (deploy/process_tree.py): every process below it
is found, those that end on their own are waited for, one that ignores SIGTERM is killed and
named, and a process that only reuses a listed pid is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from raydix.deploy.process_tree import alive, descendants, end_all

# a child that starts a grandchild which ignores SIGTERM, prints both pids, then both sleep
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
    print(os.getpid(), grandchild.pid, flush=True)
    time.sleep(60)
""")


def test_the_tree_is_found_waited_for_and_killed() -> None:
    child = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        pid, grandchild = map(int, child.stdout.readline().split())
        found = descendants(os.getpid())
        assert pid in found and grandchild in found
        assert found[pid][0].startswith("python")
        tree = {p: found[p] for p in (pid, grandchild)}
        child.terminate()  # the child ends on its own; the grandchild ignores it
        start = time.monotonic()
        killed = end_all(tree, grace_s=1.0)
        assert killed == [f"{grandchild} {found[grandchild][0]}"]
        assert 1.0 <= time.monotonic() - start < 10.0
        assert alive(tree) == {}
    finally:
        child.kill()
        child.wait()


def test_a_reused_pid_is_not_the_listed_process() -> None:
    me = descendants(os.getppid()).get(os.getpid())
    assert me is not None
    name, start = me
    assert alive({os.getpid(): (name, start)}) == {os.getpid(): (name, start)}
    assert alive({os.getpid(): (name, start + 1)}) == {}  # another start time: not ours
