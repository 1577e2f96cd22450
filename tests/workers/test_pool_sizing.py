"""The KV pool sizing rule with made-up free-memory readings per rank."""

from __future__ import annotations

import logging

import pytest

from raydix.workers.pool_sizing import (
    ForwardShape,
    estimate_headroom,
    kv_cell_size,
    profile_max_num_tokens,
)

GiB = 1 << 30


def test_cell_size_counts_k_and_v_of_every_layer() -> None:
    # SmolLM2 at TP=1: 3 KV heads x 64 x 30 layers x (K, V) x fp32
    assert kv_cell_size(3, 64, 30, 4) == 3 * 64 * 30 * 2 * 4 == 46080


def test_minimum_rank_sets_the_size() -> None:
    cell = 1000
    # total 10 GiB, fraction 0.9 -> 1 GiB held back; rank 1 has the least free memory
    tokens = profile_max_num_tokens([6 * GiB, 5 * GiB + 800_000, 6 * GiB], 10 * GiB, 0.9, cell, 1)
    expected_rest = 5 * GiB + 800_000 - 0.1 * 10 * GiB
    assert tokens == int(expected_rest // cell)
    alone = profile_max_num_tokens([5 * GiB + 800_000], 10 * GiB, 0.9, cell, 1)
    assert tokens == alone


def test_aligns_down_to_page_size() -> None:
    # rest = 1_000_000 - 0 = 1e6 bytes, cell 1000 -> 1000 tokens -> 992 with pages of 16
    assert profile_max_num_tokens([1_000_000], 1_000_000, 1.0, 1000, 1) == 1000
    assert profile_max_num_tokens([1_000_000], 1_000_000, 1.0, 1000, 16) == 992
    assert profile_max_num_tokens([1_000_000], 1_000_000, 1.0, 1000, 64) == 960


def test_capped_by_max_total_tokens_page_aligned() -> None:
    assert profile_max_num_tokens([GiB], GiB, 1.0, 100, 16, max_total_tokens=1000) == 992
    assert profile_max_num_tokens([GiB], GiB, 1.0, 100, 1, max_total_tokens=1000) == 1000


def test_warns_naming_the_low_rank(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raydix.workers.pool_sizing"):
        profile_max_num_tokens([10 * GiB, 10 * GiB, 8 * GiB, 9.5 * GiB], 16 * GiB, 0.9, 1000, 1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "[2]" in message and "rank 0" in message  # rank 2 < 90% of rank 0; rank 3 is not


def test_no_warning_when_balanced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raydix.workers.pool_sizing"):
        profile_max_num_tokens([10 * GiB, 9.1 * GiB], 16 * GiB, 0.9, 1000, 1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_logs_capacity_in_tokens_and_gb(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="raydix.workers.pool_sizing"):
        profile_max_num_tokens([2 * 10**9], 2 * 10**9, 1.0, 1000, 1)
    assert any("2000000 tokens" in r.getMessage() and "2.000 GB" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("free", [1 * GiB, 2 * GiB])
def test_error_tells_to_raise_mem_fraction_static(free: int) -> None:
    # 10 GiB total, fraction 0.8 holds back 2 GiB: nothing (or exactly nothing) is left
    with pytest.raises(ValueError, match="Raise mem_fraction_static"):
        profile_max_num_tokens([free, 9 * GiB], 10 * GiB, 0.8, 1000, 1)


def test_error_when_less_than_a_page_fits() -> None:
    with pytest.raises(ValueError, match="mem_fraction_static"):
        profile_max_num_tokens([10_000], 10_000, 1.0, 1000, 16)  # 10 tokens < one page


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        profile_max_num_tokens([], GiB, 0.9, 1000, 1)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        profile_max_num_tokens([GiB], GiB, 1.5, 1000, 1)


def _shape(**overrides: int | bool) -> ForwardShape:
    # TinyLlama-1.1B's shape at TP=1, bf16, serve's CUDA defaults
    fields: dict[str, int | bool] = dict(
        hidden_size=2048, intermediate_per_rank=5632, qkv_per_rank=(32 + 2 * 4) * 64,
        vocab_size=32000, dtype_bytes=2, max_batch_tokens=8192 + 64, max_batch=64,
        graph_max_batch=64, workspace_bytes=256 << 20, on_cuda=True)
    fields.update(overrides)
    return ForwardShape(**fields)  # type: ignore[arg-type]


def test_headroom_counts_activations_graphs_and_workspace() -> None:
    room = estimate_headroom(_shape())
    per_token = 2 * (6 * 2048 + 40 * 64 + 3 * 5632) + 8 * 2048
    assert room.activations == int(1.5 * ((8192 + 64) * per_token + 64 * 32000 * 16))
    assert room.cuda_graphs == int(1.5 * (64 * per_token + 64 * 32000 * 16))
    assert room.workspace == (256 << 20) + (256 << 20)
    assert room.total == room.activations + room.cuda_graphs + room.workspace
    # more prompt tokens per step need more room; no graphs need none for them
    assert estimate_headroom(_shape(max_batch_tokens=16384)).activations > room.activations
    assert estimate_headroom(_shape(graph_max_batch=0)).cuda_graphs == 0
    cpu = estimate_headroom(_shape(on_cuda=False, workspace_bytes=0, graph_max_batch=0))
    assert cpu.workspace == 0


def test_headroom_is_kept_when_the_fraction_keeps_less(caplog: pytest.LogCaptureFixture) -> None:
    room = estimate_headroom(_shape())
    free, total, cell = 70 * GiB, 80 * GiB, 45056
    # mem_fraction_static 0.99 keeps 0.8 GiB: less than the step needs, so the headroom wins
    with caplog.at_level(logging.INFO, logger="raydix.workers.pool_sizing"):
        tokens = profile_max_num_tokens([free], total, 0.99, cell, 16, headroom=room)
    assert tokens == int((free - room.total) // cell) // 16 * 16
    message = caplog.records[-1].getMessage()
    assert "activations" in message and "more than 1 - mem_fraction_static" in message
    # the default 0.85 keeps 12 GiB, which covers it: the fraction rules, as before
    assert (profile_max_num_tokens([free], total, 0.85, cell, 16, headroom=room)
            == profile_max_num_tokens([free], total, 0.85, cell, 16))


def test_log_says_why_the_pool_has_its_size(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="raydix.workers.pool_sizing"):
        profile_max_num_tokens([6 * GiB, 5 * GiB], 10 * GiB, 0.9, 1000, 1)
        profile_max_num_tokens([6 * GiB], 10 * GiB, 0.9, 1000, 1, max_total_tokens=100)
    first, second = (r.getMessage() for r in caplog.records[-2:])
    assert "5.00 GiB free after the weights (least over 2 rank(s))" in first
    assert "1.00 GiB kept free (1 - mem_fraction_static=0.9 of 10.00 GiB" in first
    assert "capped by max_total_tokens=100" in second
