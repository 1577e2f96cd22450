"""A CPU replica's engine process computes with glibc's malloc on 2 MiB pages
(workers/huge_pages.py), unless `disable_huge_pages` says not to; a user's own tunable stands."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.deploy.server import engine_process_env
from raydix.engine.engine import Engine
from raydix.engine.engine_process import ProcessEngine
from raydix.workers.huge_pages import malloc_env
from tests.deploy.test_engine_process import make_engine

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode (the bracketed word), "" without THP."""
    text = THP.read_text() if THP.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def huge_page_kib(engine: Engine | None = None) -> int:
    """This process's anonymous memory on transparent huge pages (kB)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages line in /proc/self/smaps_rollup")


def test_malloc_env_adds_the_tunable_beside_the_users_own() -> None:
    assert malloc_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    # a user who chose the tunable keeps the choice
    assert malloc_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"}


def test_the_engine_process_env_follows_the_device_and_the_setting(tiny_llama: Path) -> None:
    on = engine_config(AppConfig(), str(tiny_llama), "cpu")
    off = engine_config(AppConfig(disable_huge_pages=True), str(tiny_llama), "cpu")
    assert engine_process_env(on) == malloc_env()
    assert engine_process_env(off) == {}
    assert not off.worker.cpu_huge_pages


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"),
                    reason=f"the kernel gives no transparent huge pages here ({THP}: "
                           f"{thp_mode() or 'absent'})")
def test_a_cpu_engine_process_holds_huge_pages(tiny_llama: Path) -> None:
    """Started with the replica's env, the engine process's malloc'd memory (weights,
    activations, torch's and Python's heaps) is on 2 MiB pages; started without, under the
    kernel's `madvise` mode nothing is."""
    on = ProcessEngine(functools.partial(make_engine, tiny_llama),
                       env=engine_process_env(engine_config(AppConfig(), str(tiny_llama), "cpu")))
    try:
        assert asyncio.run(on.call(huge_page_kib)) >= 2048
    finally:
        on.shutdown()
    if thp_mode() == "madvise":
        off = ProcessEngine(functools.partial(make_engine, tiny_llama), env={})
        try:
            assert asyncio.run(off.call(huge_page_kib)) == 0
        finally:
            off.shutdown()
