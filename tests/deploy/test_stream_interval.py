"""`stream_interval`: a stream's tokens go out every N (the first and the last at once), each
token exactly once and in order; the setting reaches the engine replica from the CLI."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from raydix.deploy.app import replica_settings
from raydix.deploy.cli import build_parser, load_config
from raydix.engine.async_engine import AsyncEngine
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput, Usage
from raydix.engine.stream_hold import StreamHold

from .test_async_engine import PROMPTS, make_engine


def _out(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", (token,), str(token), FinishReason.LENGTH if finished else None,
                         Usage(3, 0, token))


def test_the_first_token_at_once_then_every_n_then_the_rest_at_the_end() -> None:
    hold = StreamHold(3)
    sent = [hold.due("r", [_out(t)], False) for t in range(1, 6)]
    assert [None if s is None else [o.new_token_ids[0] for o in s] for s in sent] == [
        [1], None, None, [2, 3, 4], None]
    last = hold.due("r", [_out(6, finished=True)], True)
    assert last is not None and [o.new_token_ids[0] for o in last] == [5, 6]
    assert len(hold) == 0  # nothing kept for a finished request


def test_an_interval_of_one_sends_every_step_and_aborts_drop_what_is_held() -> None:
    assert StreamHold(1).due("r", [_out(1)], False) == [_out(1)]
    hold = StreamHold(4)
    hold.due("r", [_out(1)], False)
    assert hold.due("r", [_out(2)], False) is None
    hold.drop("r")
    assert len(hold) == 0
    finished_first = StreamHold(4)
    assert finished_first.due("s", [_out(1, finished=True)], True) == [_out(1, finished=True)]
    assert len(finished_first) == 0
    with pytest.raises(ValueError, match="stream_interval"):
        StreamHold(0)


def test_the_engine_streams_the_same_tokens_in_fewer_chunks(tiny_llama: Path) -> None:
    params = GenerationParams(max_new_tokens=23, ignore_eos=True)

    async def chunks(engine: AsyncEngine, prompt: list[int]) -> list[tuple[int, ...]]:
        got = []
        async for outputs in engine.generate(prompt, params, f"r{len(prompt)}"):
            got += [out.new_token_ids for out in outputs]
        return got

    results = {}
    for interval in (1, 4):
        engine = AsyncEngine(make_engine(tiny_llama), stream_interval=interval)
        try:
            async def both(e: AsyncEngine = engine) -> list[list[tuple[int, ...]]]:
                return list(await asyncio.gather(*(chunks(e, p) for p in PROMPTS[:2])))
            results[interval] = asyncio.run(both())
            assert len(engine._hold) == 0  # nothing left behind once the streams ended
        finally:
            engine.shutdown()
    for every_step, every_four in zip(results[1], results[4], strict=True):
        assert [t for c in every_four for t in c] == [t for c in every_step for t in c]
        assert len(every_four[0]) == 1  # the first token at once
        assert all(len(c) >= 4 for c in every_four[1:-1])
        assert len(every_four) < len(every_step)


def test_the_flag_sets_the_interval_and_zero_is_refused() -> None:
    config = load_config(build_parser().parse_args(["serve", "--stream-interval", "4"]))
    assert config.stream_interval == 4
    with pytest.raises(Exception, match="stream_interval"):
        load_config(build_parser().parse_args(["serve", "--stream-interval", "0"]))


def test_the_flag_reaches_the_replica_settings() -> None:
    # what `bind_app` hands each engine replica, whose AsyncEngine takes the interval from it
    config = load_config(build_parser().parse_args(["serve", "--stream-interval", "4"]))
    assert replica_settings(config, use_gpu=False, cpu_threads=None).stream_interval == 4
    assert replica_settings(config.model_copy(update={"stream_interval": 1}), use_gpu=False,
                            cpu_threads=None).stream_interval == 1
