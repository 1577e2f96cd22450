"""Structured output in the engine: a tiny random Llama with the default model's tokenizer
writes garbage unless its grammar holds it, so a valid output is the grammar's doing.

The same seeded requests run in a roomy pool and in a tiny one with small prompt chunks, where
requests are retracted and resumed: the matcher must follow each request through its rows (a
token accepted twice, or one missed, changes the bitmask and so the tokens). Finished, aborted
and retracted requests leave no matcher behind.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.engine.request import FinishReason, GenerationParams
from raydix.workers.config import WorkerConfig
from raydix.workers.step import GrammarSpec, SamplingParams
from tests.engine.conftest import TOK_EOS as EOS
from tests.engine.test_engine import assert_drained

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


@pytest.fixture(scope="module")
def engine(tiny_tok: Path) -> Engine:
    """One roomy engine for the tests that need no special pool (each leaves it drained)."""
    return make(tiny_tok)


def make(folder: Path, max_total_tokens: int = 4000, **sched: object) -> Engine:
    defaults: dict[str, object] = dict(max_running_requests=16, max_context_len=512)
    defaults.update(sched)
    config = EngineConfig.build(WorkerConfig(model_path=str(folder),
                                             max_total_tokens=max_total_tokens),
                                SchedulerConfig(**defaults))  # type: ignore[arg-type]
    engine = Engine(config, tokenizer=AutoTokenizer.from_pretrained(folder))
    engine.step_hook = lambda sched: sched.cache.check_integrity()
    return engine


def run(engine: Engine, prompts: list[list[int]], params: list[GenerationParams]
        ) -> list[tuple[list[int], str, FinishReason | None]]:
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    got: dict[str, tuple[list[int], str, FinishReason | None]] = {r: ([], "", None) for r in rids}
    while engine.has_work:
        for out in engine.step():
            tokens, text, _ = got[out.rid]
            got[out.rid] = (tokens + list(out.new_token_ids), text + out.text, out.finish_reason)
    engine.step()  # the last finished rows are freed on the ranks with the next plan
    return [got[r] for r in rids]


def grammar_rows(engine: Engine) -> int:
    return int(engine.executor.worker.runner.grammars.num_active)  # type: ignore[attr-defined]


def prompts_of(folder: Path, num: int, length: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(10, 40_000, size=length + i % 5).tolist() for i in range(num)]


def json_params(num: int) -> list[GenerationParams]:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    return [GenerationParams(sampling=SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0,
                                                     seed=100 + i, grammar=spec),
                             max_new_tokens=80) for i in range(num)]


def test_json_schema_outputs_validate_and_the_grammar_ends_them(engine: Engine,
                                                                tiny_tok: Path) -> None:
    results = run(engine, prompts_of(tiny_tok, 8), json_params(8))
    for tokens, text, reason in results:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason is FinishReason.STOP and tokens[-1] == EOS
    assert len({text for _, text, _ in results}) > 2  # sampled, not one fixed string
    assert grammar_rows(engine) == 0
    assert_drained(engine)


def test_outputs_are_the_same_under_retraction_and_small_chunks(engine: Engine,
                                                                tiny_tok: Path) -> None:
    prompts = [p * 2 for p in prompts_of(tiny_tok, 8)]  # 24-32 tokens each
    params = json_params(8)
    roomy = run(engine, prompts, params)
    tight = make(tiny_tok, max_total_tokens=300, chunked_prefill_size=16, max_prefill_tokens=32,
                 init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    squeezed = run(tight, prompts, params)
    assert tight.metrics().num_retractions > 0
    assert [r[0] for r in squeezed] == [r[0] for r in roomy]
    for _, text, _ in squeezed:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert grammar_rows(tight) == 0
    assert_drained(tight)


def test_a_resumed_request_replays_the_output_in_its_cached_prefix(engine: Engine,
                                                                   tiny_tok: Path) -> None:
    prompt = prompts_of(tiny_tok, 1)[0]
    params = json_params(2)[1]  # sampled at temperature 1
    expected = run(engine, [prompt], [params])[0][0]
    plans = []
    step = engine.executor.step
    engine.executor.step = lambda plan: plans.append(plan) or step(plan)  # type: ignore[method-assign]
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    while len(tokens) < 8:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    engine.scheduler._retract(engine.scheduler.running[0])  # as a full pool would
    while engine.has_work:
        tokens += [t for out in engine.step() if out.rid == rid for t in out.new_token_ids]
    engine.executor.step = step  # type: ignore[method-assign]
    assert tokens == expected
    starts = [s for plan in plans for s in plan.grammar_starts]
    assert len(starts) == 2 and len(starts[1].output_ids) >= 7  # replayed from the cache


def test_penalties_and_seeds_under_a_grammar(engine: Engine, tiny_tok: Path) -> None:
    """Penalties act on the masked choice (they change the output, which stays valid); a seeded
    request gives the same tokens alone and in a batch, and under retraction, where both the
    penalties' counts and the matcher must follow the request back."""
    prompts = [p * 2 for p in prompts_of(tiny_tok, 6)]
    plain = json_params(6)
    penalised = [dataclasses.replace(q, sampling=dataclasses.replace(
        q.sampling, frequency_penalty=1.5, presence_penalty=1.0, repetition_penalty=1.3))
        for q in plain]
    unpenalised = run(engine, prompts, plain)
    batch = run(engine, prompts, penalised)
    for _, text, reason in batch:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason is FinishReason.STOP
    assert [r[0] for r in batch] != [r[0] for r in unpenalised]
    assert run(engine, prompts[1:2], penalised[1:2])[0][0] == batch[1][0]  # seeded, alone
    tight = make(tiny_tok, max_total_tokens=300, chunked_prefill_size=16, max_prefill_tokens=32,
                 init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    squeezed = run(tight, prompts, penalised)
    assert tight.metrics().num_retractions > 0
    assert [r[0] for r in squeezed] == [r[0] for r in batch]
    assert grammar_rows(tight) == 0
    assert_drained(tight)


def test_a_stop_string_ends_a_request_under_a_grammar(engine: Engine, tiny_tok: Path) -> None:
    """The output processor ends a request at its stop string before the grammar's end (as
    vLLM and SGLang do: the text stops there); its matcher goes with its row."""
    spec = GrammarSpec("regex", r"[a-z]{3,8}-[0-9]{4}")
    params = [GenerationParams(sampling=SamplingParams(temperature=1.0, seed=i, grammar=spec),
                               max_new_tokens=40, stop_strings=("-",)) for i in range(4)]
    for _, text, reason in run(engine, prompts_of(tiny_tok, 4), params):
        assert re.fullmatch(r"[a-z]{3,8}", text), text
        assert reason is FinishReason.STOP
    assert grammar_rows(engine) == 0
    assert_drained(engine)


def test_abort_with_an_active_grammar_leaves_nothing(engine: Engine, tiny_tok: Path) -> None:
    params = json_params(4)
    rids = [engine.add_request(p, q) for p, q in zip(prompts_of(tiny_tok, 4), params, strict=True)]
    for _ in range(5):
        engine.step()
    assert grammar_rows(engine) == 4
    for rid in rids[:2]:
        assert engine.abort(rid) is not None
    while engine.has_work:
        engine.step()
    engine.step()
    assert grammar_rows(engine) == 0
    assert_drained(engine)


@pytest.mark.parametrize(("kind", "source", "check"), [
    ("regex", r"[0-9]{3}-[a-z]{2,4}", lambda t: __import__("re").fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]', lambda t: t in ("yes", "no") or (
        t.startswith("maybe ") and t[-1].isdigit() and len(t) == 7)),
])
def test_regex_and_ebnf_outputs_match(engine: Engine, tiny_tok: Path, kind: str, source: str,
                                      check: object) -> None:
    params = [GenerationParams(sampling=SamplingParams(temperature=1.0, seed=i,
                                                       grammar=GrammarSpec(kind, source)),
                               max_new_tokens=40) for i in range(6)]
    for _, text, reason in run(engine, prompts_of(tiny_tok, 6), params):
        assert callable(check) and check(text), text
        assert reason is FinishReason.STOP


def test_ignore_eos_still_ends_at_the_end_of_the_grammar(engine: Engine, tiny_tok: Path) -> None:
    spec = GrammarSpec("ebnf", 'root ::= "done"')
    params = GenerationParams(sampling=SamplingParams(temperature=1.0, grammar=spec),
                              max_new_tokens=30, ignore_eos=True)
    [(_, text, reason)] = run(engine, prompts_of(tiny_tok, 1), [params])
    assert (text, reason) == ("done", FinishReason.STOP)


def test_the_overlapped_loop_gives_the_same_grammar_outputs(engine: Engine,
                                                            tiny_tok: Path) -> None:
    """A request whose grammar ends in step N is already in step N+1: its extra token is
    dropped, and the matcher that has ended is not asked for a mask again."""
    prompts = [p * 2 for p in prompts_of(tiny_tok, 8)]
    params = json_params(8)
    expected = run(engine, prompts, params)
    overlapped = make(tiny_tok, overlap_schedule=True, chunked_prefill_size=16)
    got = run(overlapped, prompts, params)
    overlapped.drain()
    assert got == expected
    assert grammar_rows(overlapped) == 0
    assert_drained(overlapped)


def test_drawing_first_gives_the_tokens_of_masking_first(engine: Engine, tiny_tok: Path) -> None:
    """On a CPU a row draws before its mask and is masked only when its grammar rejects the draw
    (the tiny model's draws are mostly garbage, so both ways run); greedy and seeded sampled
    requests get the tokens they get with every row masked before the draw; so do filtered
    requests (min-p, top-k), which are masked first either way (drawn first, their filters would
    keep other tokens)."""
    prompts = [p * 2 for p in prompts_of(tiny_tok, 8)]
    params = json_params(6)
    words = GrammarSpec("regex", r"[a-z]+( [a-z]+){3,6}")
    params += [GenerationParams(sampling=SamplingParams(temperature=1.0, seed=5 + i, grammar=words,
                                                        **f), max_new_tokens=40)  # type: ignore[arg-type]
               for i, f in enumerate([{"min_p": 0.2}, {"top_k": 5}])]
    grammars = engine.executor.worker.runner.grammars  # type: ignore[attr-defined]
    assert grammars.check_first
    rejected = grammars.rejected
    counts = {"drawn": 0, "masked": 0}  # rows drawn first; those masked after their draw

    def counted(token_ids: object) -> list[int]:
        rows = rejected(token_ids)
        counts["drawn"] += len(grammars._drawn_first)
        counts["masked"] += len(rows)
        return rows

    grammars.rejected = counted
    try:
        drawn_first = run(engine, prompts, params)
    finally:
        del grammars.rejected
    grammars.check_first = False
    try:
        masked_first = run(engine, prompts, params)
    finally:
        grammars.check_first = True
    assert [r[0] for r in drawn_first] == [r[0] for r in masked_first]
    assert 0 < counts["masked"] < counts["drawn"]
    for _, text, _ in drawn_first[:-2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    for _, text, _ in drawn_first[-2:]:
        assert re.fullmatch(r"[a-z]+( [a-z]+){3,6}", text), text
    assert_drained(engine)
