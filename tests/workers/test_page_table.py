"""The kept page table against one built from scratch, over random runs of steps (CPU tensors).

A run is a stream of steps over a request->token table filled the way the paged allocator fills
it: requests join (a row and its pages written), leave (the row freed), decode one token (a new
page when a page fills), extend several tokens between two decodes (an eager step), have their
row rewritten (the prefix cache swapping duplicate slots for the tree's), and are reordered;
the padding of a CUDA-graph batch changes now and then. After every step the table's buffers
(what a replayed graph reads) and its returned view must equal `page_table_from_scratch`, and a
step whose requests and rows did not change must not rebuild the table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydix.workers.attention.page_table import PageTable, page_table_from_scratch

NUM_ROWS, MAX_CONTEXT, NUM_PAGES = 12, 96, 4096


class _World:
    """Requests over a paged request->token table, with a version per row that counts the
    rewrites (frees and table writes) the runner's request table would count."""

    def __init__(self, rng: np.random.Generator, page_size: int) -> None:
        self.rng, self.ps = rng, page_size
        self.table = torch.zeros(NUM_ROWS, MAX_CONTEXT, dtype=torch.int32)
        self.versions = np.zeros(NUM_ROWS, np.int64)
        self.free_pages = list(rng.permutation(np.arange(1, NUM_PAGES)))
        self.pages: dict[int, list[int]] = {}  # row -> its page ids
        self.lens: dict[int, int] = {}
        self.order: list[int] = []  # the batch: rows in plan order

    def _grow(self, row: int, num_tokens: int) -> None:
        n = self.lens.get(row, 0)
        for pos in range(n, n + num_tokens):  # a test may loop over tokens; the code may not
            if pos % self.ps == 0:
                self.pages[row].append(int(self.free_pages.pop()))
            self.table[row, pos] = self.pages[row][pos // self.ps] * self.ps + pos % self.ps
        self.lens[row] = n + num_tokens

    def join(self) -> None:
        free_rows = [r for r in range(NUM_ROWS) if r not in self.lens]
        if not free_rows:
            return
        row = int(self.rng.choice(free_rows))
        self.pages[row] = []
        self._grow(row, int(self.rng.integers(1, 3 * self.ps + 2)))
        self.versions[row] += 1
        self.order.insert(int(self.rng.integers(0, len(self.order) + 1)), row)

    def leave(self) -> None:
        if len(self.order) > 1:
            row = self.order.pop(int(self.rng.integers(0, len(self.order))))
            self.free_pages += self.pages.pop(row)
            del self.lens[row]
            self.table[row] = 0
            self.versions[row] += 1

    def decode(self) -> None:
        for row in self.order:
            if self.lens[row] < MAX_CONTEXT:
                self._grow(row, 1)

    def extend_some(self) -> None:
        for row in self.order:
            room = MAX_CONTEXT - self.lens[row]
            if room and self.rng.random() < 0.5:
                self._grow(row, int(self.rng.integers(1, min(room, 2 * self.ps + 1) + 1)))

    def rewrite(self) -> None:
        """A row's whole pages get other page ids (same positions, other slots)."""
        row = int(self.rng.choice(self.order))
        whole = self.lens[row] // self.ps
        for p in range(whole):
            new = int(self.free_pages.pop())
            self.free_pages.append(self.pages[row][p])
            self.pages[row][p] = new
            self.table[row, p * self.ps: (p + 1) * self.ps] = (
                new * self.ps + torch.arange(self.ps, dtype=torch.int32))
        self.versions[row] += 1

    def batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.array(self.order, np.int64)
        lens = np.array([self.lens[r] for r in self.order], np.int64)
        return rows, lens, self.versions[rows]


def _run(kind: type[PageTable], seed: int, page_size: int,
         steps: int = 150) -> tuple[PageTable, int]:
    """Random steps; asserts the kept table equals the reference after each. Returns the table
    and how many steps changed the batch's requests or rows (each of those may rebuild)."""
    rng = np.random.default_rng(seed)
    world = _World(rng, page_size)
    table = kind(world.table, page_size, NUM_ROWS + 3, NUM_PAGES)
    for _ in range(3):
        world.join()
    padding, changed, last_key = 0, 0, None
    for _ in range(steps):
        op = rng.random()
        if op < 0.12:
            world.join()
        elif op < 0.22:
            world.leave()
        elif op < 0.30:
            world.rewrite()
        elif op < 0.34:
            rng.shuffle(world.order)
        elif op < 0.38:
            padding = int(rng.choice([0, 1, 3]))
        elif op < 0.55:
            world.extend_some()
        else:
            world.decode()
        rows, lens, versions = world.batch()
        key = (rows.tolist(), versions.tolist(), padding)
        changed += key != last_key
        last_key = key
        view = table.update(rows, lens, padding, versions)
        want = page_table_from_scratch(world.table, rows, lens, page_size, padding)
        batch, total = len(rows) + padding, int(want.indptr[-1])
        assert torch.equal(view.indptr, want.indptr)
        assert torch.equal(view.last, want.last)
        assert torch.equal(view.indices, want.indices)
        # what a replayed graph reads: the buffers themselves
        assert torch.equal(table.indptr[: batch + 1], want.indptr)
        assert torch.equal(table.last[:batch], want.last)
        assert torch.equal(table.indices[:total], want.indices)
    return table, changed


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_kept_table_equals_a_fresh_build(page_size: int, seed: int) -> None:
    table, changed = _run(PageTable, seed, page_size)
    # steps whose requests and rows did not change were updated in place, never rebuilt
    assert 0 < table.num_rebuilds <= changed < 150


class _ForgetsNewPages(PageTable):
    """Moves the tail on an update but never writes the new pages there."""

    updating = False

    def _update(self, num_pages: np.ndarray, last: np.ndarray) -> None:
        self.updating = True
        super()._update(num_pages, last)
        self.updating = False

    def _write_pages(self, rows: torch.Tensor, cols: torch.Tensor, dest: torch.Tensor) -> None:
        if not self.updating:
            super()._write_pages(rows, cols, dest)


class _IgnoresRowVersions(PageTable):
    def _can_update(self, row_idx: np.ndarray, versions: np.ndarray | None,
                    num_pages: np.ndarray, num_padding: int) -> bool:
        return super()._can_update(row_idx, self._versions if versions is not None else None,
                                   num_pages, num_padding)


@pytest.mark.parametrize("mutant", [_ForgetsNewPages, _IgnoresRowVersions])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_broken_update_is_caught(mutant: type[PageTable], page_size: int) -> None:
    """The differential check fails a table that forgets a request's new page, or that keeps
    pages of a row the prefix cache rewrote."""
    with pytest.raises(AssertionError):
        for seed in range(4):
            _run(mutant, seed, page_size)


def test_overflow_is_refused_unless_growable() -> None:
    req_to_token = torch.arange(64, dtype=torch.int32)[None].repeat(2, 1)
    rows, lens = np.array([0, 1]), np.array([40, 30])
    with pytest.raises(ValueError, match="overflows"):
        PageTable(req_to_token, 4, 2, 8).update(rows, lens)
    grown = PageTable(req_to_token, 4, 2, 8, growable=True)
    view = grown.update(rows, lens)
    assert torch.equal(view.indices, page_table_from_scratch(req_to_token, rows, lens, 4).indices)


def test_request_table_versions_the_rows_it_rewrites() -> None:
    """Frees, table writes and new tokens below a row's length bump its version; a step's
    new-token slots past the request's length do not, so the page tables keep what they read
    from that row."""
    from raydix.workers.req_table import RequestTable
    from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan, TableWrite

    table = RequestTable(4, 16, 64, torch.device("cpu"))
    decode = StepPlan.build(0, [ScheduledRequest(1, 3, [7], [9], GREEDY),
                                ScheduledRequest(2, 5, [8], [21], GREEDY)])
    table.apply(decode)
    assert table.versions.tolist() == [0, 0, 0, 0]
    rewrite = StepPlan.build(1, [ScheduledRequest(1, 4, [7], [10], GREEDY)],
                             [TableWrite(2, 0, np.array([4, 5], np.int32))], [3])
    table.apply(rewrite)
    assert table.versions.tolist() == [0, 0, 1, 1]
    # row 1 taken again from position 0 with nothing freed (a test driver's way): rewritten
    restart = StepPlan.build(2, [ScheduledRequest(1, 0, [7, 8], [30, 31], GREEDY),
                                 ScheduledRequest(2, 6, [9], [40], GREEDY)])
    table.apply(restart)
    assert table.versions.tolist() == [0, 1, 1, 1]
