"""The paged slot allocator and the request→token table, with exact slot ids."""

from __future__ import annotations

import numpy as np
import pytest

from raydix.cache import PagedSlotAllocator, ReqToTokenPool


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_alloc_takes_whole_pages_and_skips_the_padding_page(page_size: int) -> None:
    alloc = PagedSlotAllocator(num_pages=4, page_size=page_size)
    assert alloc.capacity == 4 * page_size
    assert alloc.num_slots == 5 * page_size
    first = alloc.alloc(page_size + 1)
    assert first is not None
    # page 0 (slots 0 .. page_size-1) is reserved: allocation starts at page 1
    assert first.tolist() == list(range(page_size, 2 * page_size + 1))
    assert alloc.available_size() == 2 * page_size  # two whole pages were taken
    assert alloc.alloc(3 * page_size) is None  # short: None, nothing changes
    assert alloc.available_size() == 2 * page_size


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_partial_last_page_keeps_taking_tokens(page_size: int) -> None:
    alloc = PagedSlotAllocator(num_pages=4, page_size=page_size)
    slots = alloc.alloc(page_size // 2 + 1)
    assert slots is not None
    last = int(slots[-1])
    more = alloc.alloc(page_size, last_slot=last)
    assert more is not None
    if page_size == 1:
        assert more.tolist() == [2]
    else:
        room = page_size - 1 - last % page_size
        expected = list(range(last + 1, last + 1 + room))
        expected += list(range(2 * page_size, 2 * page_size + page_size - room))
        assert more.tolist() == expected
    assert alloc.available_size() == 2 * page_size


def test_alloc_decode_fills_pages_then_opens_new_ones() -> None:
    alloc = PagedSlotAllocator(num_pages=8, page_size=4)
    a = alloc.alloc(3)  # slots 4, 5, 6: room for one more in page 1
    b = alloc.alloc(4)  # slots 8 .. 11: page 2 is full
    assert a is not None and b is not None
    nxt = alloc.alloc_decode([int(a[-1]), int(b[-1])])
    assert nxt is not None
    assert nxt.tolist() == [7, 12]
    nxt = alloc.alloc_decode([7, 12])
    assert nxt is not None
    assert nxt.tolist() == [16, 13]
    assert alloc.available_size() == 4 * 4


def test_free_many_at_once_is_fifo_and_catches_double_free() -> None:
    alloc = PagedSlotAllocator(num_pages=4, page_size=2)
    slots = alloc.alloc(8)
    assert slots is not None and slots.tolist() == list(range(2, 10))
    alloc.free(np.array([4, 5, 2]))  # pages 2 and 1
    assert alloc.available_size() == 4
    again = alloc.alloc(4)
    assert again is not None and again.tolist() == [2, 3, 4, 5]  # freed pages, sorted
    alloc.free([6, 7])
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([6])
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([8, 6])  # page 4 is allocated but page 3 is not: nothing is freed
    assert alloc.is_page_allocated(4)
    assert alloc.available_size() == 2


@pytest.mark.parametrize("bad", [-1, 33])
def test_negative_or_oversized_allocation_is_an_error(bad: int) -> None:
    alloc = PagedSlotAllocator(num_pages=2, page_size=16)
    with pytest.raises(ValueError, match=r"negative|capacity"):
        alloc.alloc(bad)
    assert alloc.available_size() == 32


def test_free_outside_the_pool_is_an_error() -> None:
    alloc = PagedSlotAllocator(num_pages=2, page_size=4)
    alloc.alloc(8)
    for bad in ([0], [3], [12], [-5]):
        with pytest.raises(ValueError, match="outside the usable range"):
            alloc.free(bad)
    assert alloc.available_size() == 0
    with pytest.raises(RuntimeError, match="double free"):
        PagedSlotAllocator(num_pages=2, page_size=1).free([1, 1])


def test_request_table_rows_and_writes() -> None:
    table = ReqToTokenPool(max_running_requests=2, max_context_len=8)
    a = table.alloc()
    b = table.alloc()
    assert (a, b) == (0, 1)
    assert table.alloc() is None
    table.write(a, 2, [7, 8, 9])
    assert table.read(a, 0, 5).tolist() == [0, 0, 7, 8, 9]
    with pytest.raises(ValueError, match="max_context_len"):
        table.write(a, 6, [1, 2, 3])
    table.free(a)
    with pytest.raises(RuntimeError, match="not allocated"):
        table.free(a)
    with pytest.raises(RuntimeError, match="not allocated"):
        table.write(a, 0, [1])
    assert table.available_size() == 1
    assert table.alloc() == 0
