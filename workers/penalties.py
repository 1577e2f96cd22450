"""Repetition, frequency and presence penalties, from each penalised request's own tokens.

A plan carries only a step's new tokens, so the driving rank rebuilds the tokens of every
penalised request: a `PenaltyStart` when the request takes a request row (its prompt length and
its cached prefix, which no step carries), then the new tokens of that row in every step. When a
step samples position p of a request, the tracker has seen positions [0, p): the whole context.
Positions >= the prompt length are output, counted for the frequency and presence penalties;
every token counts for the repetition penalty. A sampled token is counted when it comes back as
the next step's input, since the engine drops the tokens sampled after a middle prompt chunk.
A retracted request takes a new row and a new start, so nothing is counted twice.

Each penalised request holds one row of two device tables, `counts` [capacity, vocab] (output
tokens, float32) and `seen` [capacity, vocab] (bool), which grow by doubling; requests without
penalties take none. One step's bookkeeping is two scatter ops whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .step import SamplingParams, StepPlan


class PenaltyTracker:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._entry: dict[int, int] = {}  # request row -> row of the tables
        self._prompt_len: dict[int, int] = {}
        self._free: list[int] = []
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    @property
    def num_tracked(self) -> int:
        return len(self._entry)

    def update(self, plan: StepPlan) -> None:
        """Follow the plan: release freed rows, start new requests, add this step's tokens."""
        for row in plan.freed_rows:
            self._release(row)
        entries: list[np.ndarray] = []
        tokens: list[np.ndarray] = []
        output: list[np.ndarray] = []
        for start in plan.penalty_starts:
            self._release(start.row_idx)
            entry = self._take()
            self._entry[start.row_idx] = entry
            self._prompt_len[start.row_idx] = start.prompt_len
            ids = np.asarray(start.prefix_ids, dtype=np.int64)
            entries.append(np.full(len(ids), entry))
            tokens.append(ids)
            output.append(np.arange(len(ids)) >= start.prompt_len)
        if self._entry:
            starts = np.cumsum(plan.extend_lens) - plan.extend_lens
            for i, row in enumerate(plan.row_idx.tolist()):
                tracked = self._entry.get(row)
                if tracked is None:
                    continue
                n, first = int(plan.extend_lens[i]), int(starts[i])
                entries.append(np.full(n, tracked))
                tokens.append(plan.input_ids[first: first + n])
                output.append(np.arange(n) + int(plan.prefix_lens[i]) >= self._prompt_len[row])
        if entries:
            self._add(np.concatenate(entries), np.concatenate(tokens), np.concatenate(output))

    def apply(self, logits: torch.Tensor, plan: StepPlan,
              sampling: Sequence[SamplingParams]) -> torch.Tensor:
        """`logits` [B, V] (float32) with each penalised request's penalties applied;
        `sampling`: the batch's settings, in plan order."""
        # only penalised requests hold an entry
        picked = [(i, entry) for i, row in enumerate(plan.row_idx.tolist())
                  if (entry := self._entry.get(row)) is not None]
        if not picked:
            return logits
        params = [sampling[i] for i, _ in picked]
        batch_rows = torch.tensor([i for i, _ in picked], device=self.device)
        entries = torch.tensor([e for _, e in picked], device=self.device)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

        sub = logits[batch_rows]
        rep = column([p.repetition_penalty for p in params])
        sub = torch.where(self.seen[entries], torch.where(sub > 0, sub / rep, sub * rep), sub)
        counts = self.counts[entries]
        sub = (sub - column([p.frequency_penalty for p in params]) * counts
               - column([p.presence_penalty for p in params]) * (counts > 0))
        out = logits.clone()
        out[batch_rows] = sub
        return out

    def _take(self) -> int:
        if not self._free:
            old = self.counts.shape[0]
            new = max(4, 2 * old)
            counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
            seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
            counts[:old] = self.counts
            seen[:old] = self.seen
            self.counts, self.seen = counts, seen
            self._free = list(range(new - 1, old - 1, -1))
        entry = self._free.pop()
        self.counts[entry].zero_()
        self.seen[entry].zero_()
        return entry

    def _release(self, row: int) -> None:
        entry = self._entry.pop(row, None)
        if entry is not None:
            self._prompt_len.pop(row)
            self._free.append(entry)

    def _add(self, entries: np.ndarray, tokens: np.ndarray, output: np.ndarray) -> None:
        e = torch.from_numpy(entries.astype(np.int64)).to(self.device)
        t = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
        self.seen[e, t] = True
        out = torch.from_numpy(output).to(self.device)
        ones = out.to(torch.float32)
        self.counts.index_put_((e, t), ones, accumulate=True)
