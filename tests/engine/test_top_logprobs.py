"""Logprobs and the likeliest tokens per position, against transformers' log-softmax."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from raydix.engine.request import GenerationParams, RequestOutput
from raydix.workers.step import SamplingParams
from tests.engine.conftest import EngineFactory, random_prompts


@torch.inference_mode()
def reference_log_probs(folder: Path, prompt: list[int], output: list[int]) -> np.ndarray:
    """[len(output), vocab]: the log-softmax that each output token was sampled from."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits, dim=-1).numpy()


def test_top_logprobs_are_the_likeliest_tokens_of_the_raw_distribution(
        make_engine: EngineFactory, tiny_llama: Path) -> None:
    prompts = random_prompts(seed=21, groups=1, per_group=3, prefix_len=20, question_len=(4, 9))
    asks = [
        SamplingParams(temperature=0.0, return_logprob=True, top_logprobs=5),
        SamplingParams(temperature=0.0, return_logprob=True),  # the sampled token's alone
        # sampled, and penalised: the logprobs stay those of the model's distribution
        SamplingParams(temperature=0.8, seed=3, return_logprob=True, top_logprobs=20,
                       frequency_penalty=1.0),
    ]
    engine = make_engine()
    rids = [engine.add_request(p, GenerationParams(s, 12, ignore_eos=True))
            for p, s in zip(prompts, asks, strict=True)]
    outs: dict[str, list[RequestOutput]] = {r: [] for r in rids}
    while engine.has_work:
        for out in engine.step():
            outs[out.rid].append(out)
    for prompt, ask, rid in zip(prompts, asks, rids, strict=True):
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        logprobs = [lp for o in outs[rid] for lp in o.logprobs]
        tops = [top for o in outs[rid] for top in o.top_logprobs]
        ref = reference_log_probs(tiny_llama, prompt, tokens)
        assert len(logprobs) == len(tokens) == 12
        np.testing.assert_allclose(logprobs, ref[np.arange(12), tokens], atol=1e-4)
        assert len(tops) == (12 if ask.top_logprobs else 0)
        for pos, top in enumerate(tops):
            ids = [t for t, _ in top]
            values = np.array([lp for _, lp in top])
            assert len(top) == ask.top_logprobs
            np.testing.assert_allclose(values, ref[pos, ids], atol=1e-4)
            assert (np.diff(values) <= 0).all()  # likeliest first
            # nothing left out is likelier than the last one kept
            assert np.sort(ref[pos])[-ask.top_logprobs] == pytest.approx(values[-1], abs=1e-4)


def test_top_logprobs_are_bounded() -> None:
    with pytest.raises(ValueError, match="top_logprobs must be in"):
        SamplingParams(top_logprobs=21)
