"""The driving rank's grammar matchers, one per request row under a grammar.

A matcher follows the plans, as the penalties do (penalties.py): a `GrammarStart` (re)starts it
when its request takes a row, replaying the output tokens of the cached prefix; after that each
step's input tokens at positions >= the prompt length are the request's output, accepted as
they come. So a token sampled after a middle prompt chunk, which the engine drops, is never
accepted, and a retracted request starts again from its own tokens: nothing is replayed twice
and nothing of a freed row is kept.

A step's masks depend only on its plan (its input tokens are the output the matchers accept), so
they are made beside the forward: `prepare` hands the step's matchers to the mask thread, which
fills their rows of one batched token bitmask with xgrammar's batched call (one call for the
batch; xgrammar releases the GIL), and on a CPU also turns the bitmask into an additive mask
(0 where allowed, -inf where not, xgrammar's kernel on a zeroed tensor). After the forward,
`apply` waits for the thread and adds the mask to the logits (on a GPU: copies the bitmask and
applies it with xgrammar's kernel). A sampled stop token ends the request: the mask lets one
through only where the grammar may end, so its end ends the request.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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
        self._thread: ThreadPoolExecutor | None = None  # the mask thread, made on first use
        self._batch_matcher: xgrammar.BatchGrammarMatcher | None = None
        self._bitmask: torch.Tensor | None = None  # [capacity, words] int32 on the CPU
        self._additive: torch.Tensor | None = None  # [capacity, vocab] float32 (CPU logits)
        self._masks: Future[list[int]] | None = None  # this step's: the batch rows it masks
        # False: the masks are made after the forward, on the step's thread (what benchmarks
        # compare against)
        self.masks_beside_forward = True
        self._deferred: tuple[list[tuple[int, xgrammar.GrammarMatcher]], int] | None = None

    @property
    def num_active(self) -> int:
        return len(self._rows)

    def update(self, plan: StepPlan, sampling: tuple[SamplingParams, ...]) -> None:
        """Follow the plan: drop freed rows, start new matchers, accept this step's output
        tokens. `sampling`: the batch's settings in plan order (the new rows' grammars)."""
        self._wait()  # the mask thread may still read the matchers of a step that failed
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

    def prepare(self, plan: StepPlan) -> None:
        """Start making the masks of the plan's step on the mask thread (after `update`, before
        the forward): one bitmask row per grammar row whose matcher has not ended. A matcher
        that has taken its stop token is done: with the overlapped step loop its request can
        run one step more, whose token the engine drops, so it needs no mask."""
        self._wait()
        picked = [(i, state.matcher) for i, row in enumerate(plan.row_idx.tolist())
                  if (state := self._rows.get(row)) is not None
                  and not state.matcher.is_terminated()]
        if not picked:
            return
        import xgrammar as xgr

        batch, vocab = plan.batch_size, self.compiler.vocab_size
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            capacity = max(batch, 16)
            self._bitmask = xgr.allocate_token_bitmask(capacity, vocab)
            if self.device.type == "cpu":
                self._additive = torch.empty(capacity, vocab, dtype=torch.float32)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydix-masks")
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        if self.masks_beside_forward:
            self._masks = self._thread.submit(self._fill, picked, batch)
        else:
            self._deferred = (picked, batch)

    @torch.inference_mode()
    def _fill(self, picked: list[tuple[int, xgrammar.GrammarMatcher]], batch: int) -> list[int]:
        """On the mask thread: the picked rows' bitmask (and on a CPU their additive mask)."""
        import xgrammar as xgr

        assert self._bitmask is not None and self._batch_matcher is not None
        rows = [i for i, _ in picked]
        self._batch_matcher.batch_fill_next_token_bitmask([m for _, m in picked],
                                                          self._bitmask, rows)
        if self._additive is not None:
            additive = self._additive[:batch].zero_()
            xgr.apply_token_bitmask_inplace(additive, self._bitmask[:batch],
                                            vocab_size=self.compiler.vocab_size, indices=rows)
        return rows

    def _wait(self) -> list[int] | None:
        """The rows of the masks being made, once they are made (None when none are)."""
        masks, self._masks = self._masks, None
        if masks is not None:
            return masks.result()
        deferred, self._deferred = self._deferred, None
        return self._fill(*deferred) if deferred is not None else None

    def apply(self, logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """`logits` [B, V] float32 with every grammar row's disallowed tokens at -inf (a new
        tensor: the caller's logits stay those of the model)."""
        rows = self._wait()
        if rows is None:
            return logits
        import xgrammar as xgr

        batch, vocab = logits.shape
        if vocab != self.compiler.vocab_size:
            raise ValueError(f"{vocab} logits per row, but the grammars were compiled for a "
                             f"vocabulary of {self.compiler.vocab_size}")
        assert self._bitmask is not None
        if logits.device.type == "cpu" and self._additive is not None:
            return logits + self._additive[:batch]
        out = logits.clone()
        mask = self._bitmask[:batch].to(out.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(out, mask, vocab_size=vocab, indices=rows)
        return out

    def ended(self, plan: StepPlan, token_ids: np.ndarray) -> np.ndarray:
        """[B] bool: the sampled token ends its request's grammar (a stop token it allowed)."""
        done = np.zeros(len(token_ids), dtype=bool)
        for i, row in enumerate(plan.row_idx.tolist()):
            state = self._rows.get(row)
            if state is not None and int(token_ids[i]) in state.stop_token_ids:
                done[i] = True
        return done
