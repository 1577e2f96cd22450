"""The engine factory of a simulated replica (`engine/simulated_executor.py`): the model's
tokenizer and a real engine over a simulated device, for router benchmarks (`bind_app(config,
engine_factory=simulated_engine_factory(cost))`)."""

from __future__ import annotations

import functools
from typing import cast

from raydix.cache import EventSink
from raydix.engine.config import EngineConfig
from raydix.engine.detokenizer import TokenDecoder
from raydix.engine.engine import Engine
from raydix.engine.simulated_executor import SimulatedExecutor, StepCost
from raydix.workers.config import ModelConfig

from .server import EngineFactory, ReplicaSettings


def build_simulated_engine(cost: StepCost, config: EngineConfig, settings: ReplicaSettings,
                           event_sink: EventSink | None = None) -> Engine:
    """An engine whose steps are timed by `cost`; its KV pool is `max_total_tokens` (there is
    no memory to size it from). Every row samples the first token of " the" that is no EOS."""
    from transformers import AutoTokenizer

    num_tokens = config.worker.max_total_tokens
    if num_tokens is None:
        raise ValueError("a simulated replica needs max_total_tokens: there is no device memory "
                         "to size its KV pool from")
    page = config.scheduler.page_size
    tokenizer = AutoTokenizer.from_pretrained(config.worker.model_path)
    eos = set(ModelConfig.from_folder(config.worker.model_path).eos_token_ids)
    token_id = next(t for t in tokenizer.encode(" the the", add_special_tokens=False) + [0, 1, 3]
                    if t not in eos)
    executor = SimulatedExecutor(num_tokens // page * page, cost, token_id)
    return Engine(config, executor=executor, tokenizer=cast(TokenDecoder, tokenizer),
                  event_sink=event_sink, eos_token_ids=sorted(eos))


def simulated_engine_factory(cost: StepCost) -> EngineFactory:
    return functools.partial(build_simulated_engine, cost)
