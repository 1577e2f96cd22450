"""Hugging Face transformers as the reference, and the token-equality check with its near-tie rule."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

LOGIT_TOL = 1e-3  # max abs logit difference allowed in fp32
NEAR_TIE = 1e-3  # a top-2 gap this small may flip the argmax between implementations


class HFReference:
    def __init__(self, folder: str | Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        # our driver never stops early, so neither may the reference (min_new_tokens would
        # instead mask the EOS logit, which changes the argmax)
        self.model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
        return outs

    @torch.inference_mode()
    def greedy_stepwise(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens with the prompt fed one token at a time through the KV cache, so each
        position sees the rope transformers gives a sequence of its length (dynamic and
        longrope scale by the longest position of each forward)."""
        from transformers import DynamicCache

        outs = []
        for p in prompts:
            cache = DynamicCache(config=self.model.config)
            tokens, out = list(p), []
            for i in range(len(p) + max_new_tokens - 1):
                logits = self.model(torch.tensor([[tokens[i]]]), past_key_values=cache,
                                    position_ids=torch.tensor([[i]]), use_cache=True).logits
                if i >= len(p) - 1:
                    tokens.append(int(logits[0, -1].argmax()))
                    out.append(tokens[-1])
            outs.append(out)
        return outs

    @torch.inference_mode()
    def last_logits(self, seqs: list[list[int]]) -> list[np.ndarray]:
        return [self.model(torch.tensor([s])).logits[0, -1].float().numpy() for s in seqs]


def assert_greedy_equal(got: list[list[int]], ref: list[list[int]], prompts: list[list[int]],
                        hf: HFReference,
                        our_logits: Callable[[list[list[int]]], list[np.ndarray]],
                        label: str) -> None:
    """Token-for-token equality; where a near-tie flips the argmax, say so and require the logits
    to agree (max abs diff < LOGIT_TOL) at the flipped position instead."""
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert len(g) == len(r), f"{label}: request {i} made {len(g)} tokens, expected {len(r)}"
        if g == r:
            continue
        j = next(k for k in range(len(r)) if g[k] != r[k])
        seq = prompts[i] + r[:j]
        theirs = hf.last_logits([seq])[0]
        ours = our_logits([seq])[0]
        diff = float(np.abs(ours - theirs).max())
        top2 = np.sort(theirs)[-2:]
        gap = float(top2[1] - top2[0])
        assert diff < LOGIT_TOL and gap < NEAR_TIE, (
            f"{label}: request {i} differs at new token {j} ({g[j]} vs {r[j]}); "
            f"max logit diff {diff:.2e}, top-2 gap {gap:.2e}: not a near-tie")
        warnings.warn(f"{label}: request {i} flips at token {j} on a near-tie (top-2 gap "
                      f"{gap:.1e}); logits agree to {diff:.1e}", stacklevel=2)
