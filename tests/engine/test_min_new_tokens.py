"""`min_new_tokens` against transformers' `min_new_tokens`: no stop token until that many are out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raydix.engine.request import FinishReason, GenerationParams, RequestOutput
from raydix.workers.step import SamplingParams
from tests.engine.conftest import EOS, EngineFactory, random_prompts


@torch.inference_mode()
def hf_generate(folder: Path, prompt: list[int], stop: list[int], min_new: int,
                max_new: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=min_new, eos_token_id=stop,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_stop_tokens_wait_for_min_new_tokens(make_engine: EngineFactory,
                                             tiny_llama: Path) -> None:
    prompts = random_prompts(seed=41, groups=1, per_group=4, prefix_len=16, question_len=(2, 6))
    engine = make_engine()
    firsts = engine.generate(prompts, GenerationParams(max_new_tokens=1, ignore_eos=True))
    cases = []
    for prompt, [first] in zip(prompts, firsts, strict=True):
        # the greedy first token is a stop token: without min_new_tokens the request stops at once
        stop = SamplingParams(temperature=0.0, stop_token_ids=(first,))
        for min_new in (0, 5):
            cases.append((prompt, first, min_new,
                          GenerationParams(stop, max_new_tokens=12, min_new_tokens=min_new)))
    rids = [engine.add_request(prompt, params) for prompt, _, _, params in cases]
    outs: dict[str, list[RequestOutput]] = {r: [] for r in rids}
    while engine.has_work:
        for out in engine.step():
            outs[out.rid].append(out)
    for rid, (prompt, first, min_new, _) in zip(rids, cases, strict=True):
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        expected = hf_generate(tiny_llama, prompt, [first, EOS], min_new, 12)
        assert tokens == expected, (min_new, tokens, expected)
        assert first not in tokens[:min_new] and EOS not in tokens[:min_new]
        if min_new == 0:
            assert tokens == [first] and outs[rid][-1].finish_reason is FinishReason.STOP


def test_min_new_tokens_is_checked() -> None:
    with pytest.raises(ValueError, match="min_new_tokens must be in"):
        GenerationParams(max_new_tokens=4, min_new_tokens=5)
