"""The token stream from the engine's loop thread: one wake-up of the caller's event loop per
step for all its requests, and a caller that falls behind gets the steps it missed as one
chunk, with nothing lost or reordered and no timer holding the first token."""

from __future__ import annotations

import asyncio
from pathlib import Path

from raydix.engine.async_engine import AsyncEngine
from raydix.engine.request import (
    FinishReason,
    GenerationParams,
    RequestOutput,
    Usage,
    merge_outputs,
)

from .test_async_engine import PROMPTS, make_engine

PARAMS = GenerationParams(max_new_tokens=40, ignore_eos=True)


def test_a_slow_reader_gets_the_missed_steps_as_one_chunk(tiny_llama: Path) -> None:
    engine = AsyncEngine(make_engine(tiny_llama))

    async def read(rid: str, prompt: list[int], delay_s: float) -> list[list[RequestOutput]]:
        chunks = []
        async for outputs in engine.generate(prompt, PARAMS, rid):
            chunks.append(outputs)
            await asyncio.sleep(delay_s)  # a slow client: steps pile up meanwhile
        return chunks

    async def run() -> tuple[list[list[RequestOutput]], list[list[RequestOutput]]]:
        fast, slow = await asyncio.gather(read("fast", PROMPTS[0], 0.0),
                                          read("slow", PROMPTS[1], 0.05))
        return fast, slow

    try:
        fast, slow = asyncio.run(run())
    finally:
        engine.shutdown()
    expected = make_engine(tiny_llama).generate(PROMPTS[:2], PARAMS)
    for chunks, tokens in ((fast, expected[0]), (slow, expected[1])):
        assert [t for c in chunks for out in c for t in out.new_token_ids] == tokens
        assert chunks[-1][-1].finished and not any(o.finished for c in chunks[:-1] for o in c)
    assert sum(len(out.new_token_ids) for out in slow[0]) == 1  # the first token at once
    assert len(slow) < len(fast) / 2  # the slow reader's chunks carried several steps
    assert all(len(c) == 1 for c in slow + fast)  # each chunk's steps merged into one output
    assert max(len(c[0].new_token_ids) for c in slow) > 1


def test_one_wake_up_per_step_for_all_streams(tiny_llama: Path) -> None:
    engine = AsyncEngine(make_engine(tiny_llama))
    wake_ups = 0

    async def run() -> int:
        nonlocal wake_ups
        loop = asyncio.get_running_loop()
        call = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            nonlocal wake_ups
            wake_ups += 1
            return call(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        async def drain(rid: str, prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, PARAMS, rid):
                pass

        await asyncio.gather(*(drain(f"r{i}", p) for i, p in enumerate(PROMPTS)))
        return engine.engine.num_steps

    try:
        num_steps = asyncio.run(run())
    finally:
        engine.shutdown()
    assert wake_ups <= num_steps  # not one per request and step (4 streams here)


def test_merged_outputs_keep_every_token_in_order() -> None:
    usage = [Usage(5, 0, i) for i in (1, 2, 4)]
    steps = [RequestOutput("r", (7,), "a", None, usage[0], (-0.5,), (((7, -0.5),),),
                           ("a",), (("a",),)),
             RequestOutput("r", (8,), "", None, usage[1], (-0.25,), (((8, -0.25),),),
                           ("",), (("",),)),
             RequestOutput("r", (9, 10), "bc", FinishReason.LENGTH, usage[2], (-1.0, -2.0),
                           (((9, -1.0),), ((10, -2.0),)), ("b", "c"), (("b",), ("c",)))]
    merged = merge_outputs(steps)
    # with logprobs, each token's own text too: the responses pair them with the logprobs
    assert merged == RequestOutput("r", (7, 8, 9, 10), "abc", FinishReason.LENGTH, usage[2],
                                   (-0.5, -0.25, -1.0, -2.0),
                                   (((7, -0.5),), ((8, -0.25),), ((9, -1.0),), ((10, -2.0),)),
                                   ("a", "", "b", "c"), (("a",), ("",), ("b",), ("c",)))
    assert merge_outputs(steps[:1]) is steps[0]
