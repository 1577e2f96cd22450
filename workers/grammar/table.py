"""The driving rank's grammar matchers, one per request row under a grammar.

A matcher follows the plans, as the penalties do (penalties.py): a `GrammarStart` (re)starts it
when its request takes a row, replaying the output tokens of the cached prefix; after that each
step's input tokens at positions >= the prompt length are the request's output, accepted as
they come. So a token sampled after a middle prompt chunk, which the engine drops, is never
accepted, and a retracted request starts again from its own tokens: nothing is replayed twice
and nothing of a freed row is kept.

Before sampling, each matcher fills its row of the token bitmask, and the masked logits are set
to -inf (xgrammar's kernel, on the logits' device). A sampled stop token ends the request: the
mask lets one through only where the grammar may end, so its end ends the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..step import GrammarSpec, SamplingParams, StepPlan
from .compiler import GrammarCompiler

if TYPE_CHECKING:
    import xgrammar


class _Row:
    def __init__(self, matcher: xgrammar.GrammarMatcher, prompt_len: int,
                 stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.next_pos = prompt_len  # the position of the next output token to accept
        self.stop_token_ids = stop_token_ids

    def accept(self, token_ids: np.ndarray) -> None:
        for token in token_ids.tolist():
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"token {token} at position {self.next_pos} breaks the "
                                   "request's grammar")
            self.next_pos += 1


class GrammarTable:
    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.device = device
        self._rows: dict[int, _Row] = {}
        self._bitmask: torch.Tensor | None = None  # [capacity, words] int32 on the CPU

    @property
    def num_active(self) -> int:
        return len(self._rows)

    def update(self, plan: StepPlan, sampling: tuple[SamplingParams, ...]) -> None:
        """Follow the plan: drop freed rows, start new matchers, accept this step's output
        tokens. `sampling`: the batch's settings in plan order (the new rows' grammars)."""
        for row in plan.freed_rows:
            self._rows.pop(row, None)
        if plan.grammar_starts:
            grammar_of = {r: p.grammar for r, p in zip(plan.row_idx.tolist(), sampling,
                                                       strict=True)}
            for start in plan.grammar_starts:
                spec = grammar_of.get(start.row_idx)
                if spec is None:
                    raise ValueError(f"request row {start.row_idx} starts a grammar but runs "
                                     "no grammar in this step")
                self._rows[start.row_idx] = self._start(spec, start.prompt_len,
                                                         start.output_ids)
        if not self._rows:
            return
        starts = np.cumsum(plan.extend_lens) - plan.extend_lens
        for i, row in enumerate(plan.row_idx.tolist()):
            state = self._rows.get(row)
            if state is None:
                continue
            first_pos = int(plan.prefix_lens[i])
            end_pos = first_pos + int(plan.extend_lens[i])
            if end_pos <= state.next_pos:
                continue  # prompt tokens, or output the matcher already holds
            if first_pos > state.next_pos:
                raise RuntimeError(f"request row {row}: the grammar matcher is at position "
                                   f"{state.next_pos} but this step starts at {first_pos}")
            skip = state.next_pos - first_pos
            token_start = int(starts[i])
            state.accept(plan.input_ids[token_start + skip: token_start + int(plan.extend_lens[i])])

    def _start(self, spec: GrammarSpec, prompt_len: int, output_ids: np.ndarray) -> _Row:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compiler.get(spec))
        state = _Row(matcher, prompt_len, frozenset(matcher.stop_token_ids))
        state.accept(np.asarray(output_ids))
        return state

    def apply(self, logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """`logits` [B, V] float32 with every grammar row's disallowed tokens at -inf (a copy:
        the caller's logits stay those of the model)."""
        # a matcher that has taken its stop token is done: with the overlapped step loop its
        # request can run one step more, whose token the engine drops, so it needs no mask
        picked = [(i, state) for i, row in enumerate(plan.row_idx.tolist())
                  if (state := self._rows.get(row)) is not None
                  and not state.matcher.is_terminated()]
        if not picked:
            return logits
        import xgrammar as xgr

        batch = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = xgr.allocate_token_bitmask(max(batch, 16), logits.shape[1])
        bitmask = self._bitmask
        for i, state in picked:
            state.matcher.fill_next_token_bitmask(bitmask, i)
        rows = [i for i, _ in picked]
        out = logits.clone()
        mask = bitmask[:batch]
        if out.device.type != "cpu":
            mask = mask.to(out.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(out, mask, vocab_size=logits.shape[1], indices=rows)
        return out

    def ended(self, plan: StepPlan, token_ids: np.ndarray) -> np.ndarray:
        """[B] bool: the sampled token ends its request's grammar (a stop token it allowed)."""
        done = np.zeros(len(token_ids), dtype=bool)
        for i, row in enumerate(plan.row_idx.tolist()):
            state = self._rows.get(row)
            if state is not None and int(token_ids[i]) in state.stop_token_ids:
                done[i] = True
        return done
