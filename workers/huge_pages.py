"""2 MiB pages for a CPU rank's weights and activations.

A CPU decode step streams every weight from memory. On 4 KiB pages that is a TLB miss every
4 KiB, each a page-table walk (two-dimensional in a virtual machine), and the hardware
prefetchers stop at each page's end; SmolLM2-135M's bf16 weights span 65,000 such pages. On
2 MiB pages they span 130. Measured (two engines in one process on the Zen 5 VM, the weights of
one collapsed to 2 MiB pages, 4 rounds alternated): one stream 1.06-1.15x the tokens/s, four
streams 1.03-1.22x (README, session 33).

Linux gives transparent huge pages to memory advised `MADV_HUGEPAGE` under its default
`madvise` mode (`/sys/kernel/mm/transparent_hugepage/enabled`; under `always` all anonymous
memory gets them, under `never` none, and this changes nothing). glibc's malloc advises its
heaps and large blocks itself when the process starts with the tunable
`glibc.malloc.hugetlb=1` (glibc 2.35+; other C libraries and older glibc ignore it). oneDNN's
packed weights and torch's tensors come from malloc, so raydix starts the processes that compute
on a CPU with it (`malloc_env`): the engine process, the ranks' actors. A process already
running cannot take it: an engine built in the caller's own process keeps 4 KiB pages.

The KV pool stays on 4 KiB pages (`host_memory.zeroed`): it is touched lazily, slot by slot, and
its slots are handed out in order, so on 2 MiB pages every layer's K and V buffers crossed into a
fresh huge page at the same prompt and the kernel zeroed 120 MB at once: one lone 512-token
prompt in eight took 570-690 ms instead of 200.
"""

from __future__ import annotations

import os

MALLOC_TUNABLE = "glibc.malloc.hugetlb"
TUNABLES_ENV = "GLIBC_TUNABLES"


def malloc_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`GLIBC_TUNABLES` for a process to start with malloc on huge pages: the value in `env`
    (default: this process's environment) with `glibc.malloc.hugetlb=1` added, unless it already
    sets that tunable (a user's choice stands)."""
    current = (os.environ if env is None else env).get(TUNABLES_ENV, "")
    tunables = [t for t in current.split(":") if t]
    if not any(t.split("=", 1)[0] == MALLOC_TUNABLE for t in tunables):
        tunables.append(f"{MALLOC_TUNABLE}=1")
    return {TUNABLES_ENV: ":".join(tunables)}
