"""Host time of a decode step's page table, kept (updated from what changed) against built
again page by page, in one run; on CUDA also the host time of a CUDA-graph replay's planning
with `cuda_graph_plan` once against every_step.

Workload: `--batch` requests of `--context` tokens decode `--steps` steps together; each step
writes one new slot per request into the request->token table (untimed, as the runner does
before the forward), then the page table is made for the step. Timed per step:

- rebuilt: the page-by-page build the flashinfer backend ran every step before the table was
  kept (each page's row and column made on the host, copied over, gathered on the device);
- kept: `PageTable.update` (last-page lengths always, new pages and the shifted tail when a
  request crossed a page; host work per request, never per page).

Also counted, over one step where every request crosses a page: the device operators each
dispatches (a torch dispatch mode) plus its host->device copies, i.e. the launches a GPU step
would make; the flashinfer plan's own copies are not in the rebuilt count.

On CUDA the times are host times (the call's return, no synchronize): what the GPU waits for
before a graph replay. `--cuda` adds FlashInferAttentionBackend.plan_graph of a graph of the
batch's size, planned once (a replay writes the page table) and before every replay.

    python benchmarks/page_table_bench.py [--batch 1 16 64] [--context 512 2048]
        [--page-size 1 16] [--steps 200] [--cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import raydix.workers.attention.page_table as page_table
from raydix.workers.attention.page_table import PageTable
from raydix.workers.op_census import op_census
from raydix.workers.req_table import to_device


def rebuilt(req_to_token: torch.Tensor, row_idx: np.ndarray, seq_lens: np.ndarray,
            page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-page build (the backend's former `_page_table`)."""
    device = req_to_token.device
    num_pages = (seq_lens + page_size - 1) // page_size
    starts = np.cumsum(num_pages) - num_pages
    owner = np.repeat(np.arange(len(row_idx)), num_pages)
    cols = (np.arange(int(num_pages.sum())) - np.repeat(starts, num_pages)) * page_size
    rows_t, cols_t = _upload(row_idx[owner], device), _upload(cols, device)
    indices = torch.div(req_to_token[rows_t, cols_t], page_size, rounding_mode="floor").int()
    last = seq_lens - (num_pages - 1) * page_size
    indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    return torch.from_numpy(indptr), indices, torch.from_numpy(last.astype(np.int32))


UPLOADS = [0]  # host->device copies made


def _upload(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    UPLOADS[0] += 1
    return to_device(arr, device)


def launches(work: Workload, make: Callable[[Workload], object]) -> int:
    """Device operators and host->device copies of one step that crosses a page everywhere."""
    while int(work.lens[0]) % work.ps:
        work.advance()
        make(work)
    work.advance()
    UPLOADS[0] = 0
    page_table.to_device = _upload  # type: ignore[assignment]
    try:
        with op_census(nn.ModuleList()) as census:
            make(work)
    finally:
        page_table.to_device = to_device
    return census.total + UPLOADS[0]


class Workload:
    """A request->token table of `batch` requests on shuffled pages, decoding together."""

    def __init__(self, batch: int, context: int, page_size: int, steps: int,
                 device: torch.device) -> None:
        self.ps, self.batch = page_size, batch
        max_len = context + steps + 2 * page_size + 2  # room for `launches` too
        pages_each = -(-max_len // page_size)
        rng = np.random.default_rng(0)
        pages = rng.permutation(batch * pages_each)[: batch * pages_each] + 1
        self.pages = pages.reshape(batch, pages_each)
        pos = np.arange(max_len)
        table = self.pages[:, pos // page_size] * page_size + pos % page_size
        self.full = torch.from_numpy(table.astype(np.int32)).to(device)
        self.table = torch.zeros_like(self.full)
        self.table[:, :context] = self.full[:, :context]
        self.rows = np.arange(batch, dtype=np.int64)
        self.lens = np.full(batch, context, np.int64)
        self.versions = np.zeros(batch, np.int64)

    def advance(self) -> None:
        pos = int(self.lens[0])
        self.table[:, pos] = self.full[:, pos]
        self.lens += 1


def time_steps(works: list[Workload], steps: int,
               makes: list[Callable[[Workload], object]], sync: bool) -> list[float]:
    """Median host microseconds per step of each `make` on its workload, the makes taking
    turns step by step (a busy neighbour slows both alike)."""
    times: list[list[float]] = [[] for _ in makes]
    for _ in range(steps):
        for work, make, spent in zip(works, makes, times, strict=True):
            work.advance()
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            make(work)
            spent.append(time.perf_counter() - start)
    if sync:
        torch.cuda.synchronize()
    return [statistics.median(t) * 1e6 for t in times]


def table_row(batch: int, context: int, ps: int, steps: int, device: torch.device) -> dict:
    sync = device.type == "cuda"
    works = [Workload(batch, context, ps, steps, device) for _ in range(2)]
    kept = PageTable(works[1].table, ps, batch, works[1].full.shape[1] * batch // ps + batch)
    makes: list[Callable[[Workload], object]] = [
        lambda w: rebuilt(w.table, w.rows, w.lens, w.ps),
        lambda w: kept.update(w.rows, w.lens, 0, w.versions)]
    old, new = time_steps(works, steps, makes, sync)
    old_ops, new_ops = (launches(w, m) for w, m in zip(works, makes, strict=True))
    return dict(device=device.type, batch=batch, context=context, page_size=ps,
                rebuilt_us=round(old, 1), kept_us=round(new, 1), ratio=round(old / new, 2),
                rebuilt_ops=old_ops, kept_ops=new_ops, kept_rebuilds=kept.num_rebuilds)


def plan_row(batch: int, context: int, ps: int, steps: int) -> dict:
    """plan_graph's host time, graph_plan once against every_step (CUDA, flashinfer)."""
    from raydix.workers.attention.flashinfer_backend import FlashInferAttentionBackend
    from raydix.workers.kv_pool import KVPool, KVPoolConfig

    works, plans = [], []
    for mode in ("once", "every_step"):
        work = Workload(batch, context, ps, steps, torch.device("cuda"))
        num_pages = int(work.pages.max()) + 1
        # TinyLlama-1.1B's attention per rank: 32 query heads over 4 KV heads of 64, 22 layers
        pool = KVPool(KVPoolConfig(num_pages, ps, 22, 4, 64, torch.bfloat16), "cuda")
        backend = FlashInferAttentionBackend(pool, work.table, 32, 64, graph_plan=mode)
        backend.init_graph_state([batch], work.full.shape[1])
        slots = torch.zeros(batch, dtype=torch.int32, device="cuda")

        def plan(w: Workload, backend: FlashInferAttentionBackend = backend,
                 slots: torch.Tensor = slots) -> None:
            backend.plan_graph(batch, w.rows, w.lens, slots, w.versions)

        works.append(work)
        plans.append(plan)
    once, every = time_steps(works, steps, plans, True)
    return dict(batch=batch, context=context, page_size=ps, once_us=round(once, 1),
                every_step_us=round(every, 1), ratio=round(every / once, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cuda", action="store_true", help="also on the GPU, and plan_graph")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if args.cuda else [])
    rows = []
    print("page table host time per decode step (median us): rebuilt page by page vs kept")
    print(f"{'device':>6} {'batch':>5} {'context':>7} {'page':>4} {'rebuilt':>9} {'kept':>8} "
          f"{'ratio':>6} {'launches rebuilt/kept':>22}")
    for device in devices:
        for batch in args.batch:
            for context in args.context:
                for ps in args.page_size:
                    r = table_row(batch, context, ps, args.steps, device)
                    rows.append(r)
                    print(f"{r['device']:>6} {batch:>5} {context:>7} {ps:>4} "
                          f"{r['rebuilt_us']:>9} {r['kept_us']:>8} {r['ratio']:>6} "
                          f"{r['rebuilt_ops']:>14}/{r['kept_ops']}")
    if args.cuda:
        print("\nplan_graph host time per replay (median us): cuda_graph_plan every_step vs once")
        for batch in args.batch:
            for context in args.context:
                for ps in args.page_size:
                    r = plan_row(batch, context, ps, args.steps)
                    rows.append(r)
                    print(f"  batch {batch:>3} context {context:>5} page {ps:>2}: every_step "
                          f"{r['every_step_us']} us, once {r['once_us']} us, ratio {r['ratio']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
