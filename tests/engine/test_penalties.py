"""Repetition, frequency and presence penalties against transformers' `generate` on the same weights.

transformers applies the repetition penalty itself (`repetition_penalty=`); the frequency and
presence penalties, which it lacks, are a logits processor written here from OpenAI's formula.
The engine runs the prompts together, with prefix-cache hits, chunked prompts and retraction,
so a penalty computed over the wrong tokens (a cached prefix missed, a prompt token counted as
output, an output counted twice after a retraction) changes the tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from raydix.engine.request import GenerationParams
from raydix.workers.step import SamplingParams
from tests.engine.conftest import EngineFactory, random_prompts
from tests.engine.test_engine import assert_drained

NEW_TOKENS = 24


class OutputPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the tokens after the prompt."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    return model


@torch.inference_mode()
def reference(hf: torch.nn.Module, prompts: list[list[int]], sampling: SamplingParams
              ) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        processors = LogitsProcessorList()
        if sampling.frequency_penalty or sampling.presence_penalty:
            processors.append(OutputPenalties(len(p), sampling.frequency_penalty,
                                              sampling.presence_penalty))
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0, logits_processor=processors,
                          repetition_penalty=sampling.repetition_penalty)
        outs.append(out[0, len(p):].tolist())
    return outs


PENALTIES = {
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.3),
    "frequency_presence": SamplingParams(temperature=0.0, frequency_penalty=0.7,
                                         presence_penalty=0.4),
    "all_three": SamplingParams(temperature=0.0, repetition_penalty=0.9, frequency_penalty=0.5,
                                presence_penalty=-0.3),
}


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_penalties_match_transformers_with_cache_hits_and_chunks(
        make_engine: EngineFactory, hf: torch.nn.Module, name: str) -> None:
    sampling = PENALTIES[name]
    prompts = random_prompts(seed=11, groups=2, per_group=4, prefix_len=40, question_len=(3, 12))
    expected = reference(hf, prompts, sampling)
    assert expected != reference(hf, prompts, SamplingParams(temperature=0.0)), \
        "the penalty changes nothing on these prompts: the test would not see it"
    # unpenalised requests share the batch and must keep their own tokens
    plain = GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    params = GenerationParams(sampling=sampling, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine = make_engine(max_prefill_tokens=96, chunked_prefill_size=32)
    rids = [engine.add_request(p, params) for p in prompts]
    plain_rids = [engine.add_request(p, plain) for p in prompts[:3]]
    got = _run(engine, rids + plain_rids)
    assert [got[r] for r in rids] == expected
    assert [got[r] for r in plain_rids] == reference(hf, prompts[:3], SamplingParams(temperature=0.0))
    assert engine.metrics().num_cached_tokens > 0
    assert_drained(engine)
    engine.step()  # the last finished rows are freed on the ranks with the next plan
    assert engine.executor.worker.runner.penalties.num_tracked == 0  # type: ignore[attr-defined]


def test_penalties_survive_retraction(make_engine: EngineFactory, hf: torch.nn.Module) -> None:
    sampling = PENALTIES["all_three"]
    prompts = random_prompts(seed=12, groups=2, per_group=6, prefix_len=24, question_len=(8, 16))
    params = GenerationParams(sampling=sampling, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine = make_engine(max_total_tokens=200, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    assert engine.generate(prompts, params) == reference(hf, prompts, sampling)
    assert engine.metrics().num_retractions > 0
    assert_drained(engine)


def _run(engine: object, rids: list[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_work:  # type: ignore[attr-defined]
        for out in engine.step():  # type: ignore[attr-defined]
            tokens[out.rid] += list(out.new_token_ids)
    return tokens


def test_a_resumed_request_counts_the_output_in_its_cached_prefix(
        make_engine: EngineFactory, hf: torch.nn.Module) -> None:
    # without penalties this prompt repeats output token 78 at once; the 78 falls inside the
    # cached prefix the resumed request matches, so only its start can count it
    sampling = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    prompt = random_prompts(seed=14, groups=1, per_group=1, prefix_len=24, question_len=(8, 8))[0]
    params = GenerationParams(sampling=sampling, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine = make_engine()
    plans = []
    step = engine.executor.step
    engine.executor.step = lambda plan: plans.append(plan) or step(plan)  # type: ignore[method-assign]
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    while len(tokens) < 7:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    engine.scheduler._retract(engine.scheduler.running[0])  # as a full pool would
    tokens += _run(engine, [rid])[rid]
    assert tokens == reference(hf, [prompt], sampling)[0]
    # the resumed request's start carried output tokens, from the prefix cache
    starts = [s for plan in plans for s in plan.penalty_starts]
    assert len(starts) == 2 and len(starts[1].prefix_ids) > len(prompt)
