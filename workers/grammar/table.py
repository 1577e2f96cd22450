"""The driving rank's grammar matchers, one per request row under a grammar.

A matcher follows the plans, as the penalties do (penalties.py): a `GrammarStart` (re)starts it
when its request takes a row, replaying the output tokens of the cached prefix; after that each
step's input tokens at positions >= the prompt length are the request's output, accepted as
they come. So a token sampled after a middle prompt chunk, which the engine drops, is never
accepted, and a retracted request starts again from its own tokens: nothing is replayed twice
and nothing of a freed row is kept.

A row's masks depend only on its plan (its input tokens are the output the matchers accept).
On a CPU a mask costs CPU time the forward needs (xgrammar takes 2-5 ms a row inside a
length-bounded JSON string, a few microseconds elsewhere), so most rows draw first and are
masked only when their grammar rejects what they drew: a greedy row, or one sampled with no
top-k, top-p or min-p, draws the token its mask would leave it whenever the grammar allows the
unmasked draw (the argmax, or the exponential race's winner: over the allowed tokens the race
picks the same one, as renormalising scales every allowed score alike). `rejected` lets each
such row's matcher take its drawn token and give it back (xgrammar's batched accept and
rollback); `mask` fills the rejected rows' bitmask with xgrammar's batched call and applies it
to those rows with xgrammar's kernel, and the sampler draws them again with the same noise.
The other rows (with a filter, or every row when `check_first` is off, as on a GPU) are masked
before sampling, their masks made beside the forward: `prepare` hands their matchers to the mask
thread, which fills their rows of one batched token bitmask (xgrammar releases the GIL), and
after the forward `apply` waits for it and applies it (on a GPU, the bitmask copied over first).
A sampled stop token ends the request: the grammar lets one through only where it may end, so
its end ends the request.
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
        self._masks: Future[list[int]] | None = None  # this step's: the batch rows masked first
        # this step's rows that draw before any mask: (batch row, matcher)
        self._drawn_first: list[tuple[int, xgrammar.GrammarMatcher]] = []
        # True: rows that may draw first do (a CPU's way); False: every grammar row is masked
        # before sampling (a GPU's way: no host sync between the draw and the mask)
        self.check_first = device.type == "cpu"

    @property
    def num_active(self) -> int:
        return len(self._rows)

    def update(self, plan: StepPlan, sampling: tuple[SamplingParams, ...]) -> None:
        """Follow the plan: drop freed rows, start new matchers, accept this step's output
        tokens. `sampling`: the batch's settings in plan order (the new rows' grammars)."""
        self._wait()  # the mask thread may still read the matchers of a step that failed
        self._drawn_first = []
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

    def prepare(self, plan: StepPlan, sampling: tuple[SamplingParams, ...]) -> None:
        """Sort the plan's grammar rows (after `update`, before the forward): those that draw
        first, and those masked first, whose masks the mask thread starts making now. A matcher
        that has taken its stop token is done: with the overlapped step loop its request can
        run one step more, whose token the engine drops, so it needs no mask."""
        self._wait()
        picked = [(i, state.matcher) for i, row in enumerate(plan.row_idx.tolist())
                  if (state := self._rows.get(row)) is not None
                  and not state.matcher.is_terminated()]
        if not picked:
            return
        import xgrammar as xgr

        batch = plan.batch_size
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = xgr.allocate_token_bitmask(max(batch, 16), self.compiler.vocab_size)
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        if self.check_first:
            self._drawn_first = [(i, m) for i, m in picked if _draws_first(sampling[i])]
            picked = [(i, m) for i, m in picked if not _draws_first(sampling[i])]
            if not picked:
                return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydix-masks")
        self._masks = self._thread.submit(self._fill, picked)

    def _fill(self, picked: list[tuple[int, xgrammar.GrammarMatcher]]) -> list[int]:
        """On the mask thread: the picked rows' bitmask; their batch rows."""
        assert self._bitmask is not None and self._batch_matcher is not None
        rows = [i for i, _ in picked]
        self._batch_matcher.batch_fill_next_token_bitmask([m for _, m in picked],
                                                          self._bitmask, rows)
        return rows

    def _wait(self) -> list[int] | None:
        """The rows of the masks being made, once they are made (None when none are)."""
        masks, self._masks = self._masks, None
        return masks.result() if masks is not None else None

    def apply(self, logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """`logits` [B, V] float32 with the disallowed tokens of the rows masked first at -inf
        (a new tensor: the caller's logits stay those of the model)."""
        rows = self._wait()
        if rows is None:
            return logits
        import xgrammar as xgr

        self._check_vocab(logits)
        assert self._bitmask is not None
        out = logits.clone()
        mask = self._bitmask[:logits.shape[0]].to(out.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(out, mask, vocab_size=self.compiler.vocab_size,
                                        indices=rows)
        return out

    def rejected(self, token_ids: torch.Tensor) -> list[int]:
        """The batch rows that drew first whose drawn token (`token_ids` [B], on the CPU) their
        grammar does not allow. Each matcher takes its row's token and gives it back."""
        if not self._drawn_first:
            return []
        import xgrammar as xgr

        rows = [i for i, _ in self._drawn_first]
        matchers = [m for _, m in self._drawn_first]
        allowed = xgr.BatchGrammarMatcher.batch_accept_token(matchers, token_ids[rows].tolist())
        taken = [m for m, ok in zip(matchers, allowed, strict=True) if ok]
        if taken:
            xgr.BatchGrammarMatcher.batch_rollback(taken, 1)
        return [i for i, ok in zip(rows, allowed, strict=True) if not ok]

    def mask(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`logits` [len(rows), V] float32 of the batch rows `rows` (of those `rejected` named;
        a tensor the caller owns) with their disallowed tokens at -inf, in place."""
        import xgrammar as xgr

        self._check_vocab(logits)
        assert self._bitmask is not None and self._batch_matcher is not None
        matcher_of = dict(self._drawn_first)
        self._batch_matcher.batch_fill_next_token_bitmask(
            [matcher_of[i] for i in rows], self._bitmask, list(range(len(rows))))
        xgr.apply_token_bitmask_inplace(logits, self._bitmask[:len(rows)],
                                        vocab_size=self.compiler.vocab_size)
        return logits

    def _check_vocab(self, logits: torch.Tensor) -> None:
        if logits.shape[1] != self.compiler.vocab_size:
            raise ValueError(f"{logits.shape[1]} logits per row, but the grammars were compiled "
                             f"for a vocabulary of {self.compiler.vocab_size}")

    @property
    def draws_first(self) -> bool:
        """Whether some row of this step draws before its mask (`rejected` then has work)."""
        return bool(self._drawn_first)

    def ended(self, plan: StepPlan, token_ids: np.ndarray) -> np.ndarray:
        """[B] bool: the sampled token ends its request's grammar (a stop token it allowed)."""
        done = np.zeros(len(token_ids), dtype=bool)
        for i, row in enumerate(plan.row_idx.tolist()):
            state = self._rows.get(row)
            if state is not None and int(token_ids[i]) in state.stop_token_ids:
                done[i] = True
        return done


def _draws_first(params: SamplingParams) -> bool:
    """Whether an unmasked draw that the grammar allows is the masked draw's token: greedy, or
    sampled with no filter (a top-k, top-p or min-p set depends on which tokens are allowed)."""
    return params.is_greedy or (params.top_k <= 0 and params.top_p >= 1.0
                                and params.min_p <= 0.0)
