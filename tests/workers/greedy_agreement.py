"""Greedy tokens of two bf16 paths: the same, or parting only where the reference nearly ties.

Two bf16 paths round at different points, so each logit may differ by up to `BF16_LOGITS`'
atol between them; their greedy picks can then part where the reference's two best logits are
within twice that, and every later token follows a different context. A path that reads a wrong
slot, position or head moves logits by whole units and parts where the reference does not tie.
"""

from __future__ import annotations

from raydix.workers.worker import TPWorker

from .tp_group import probe_plan

BF16_TIE = 0.2  # two paths each within 0.1 of the other (BF16_LOGITS) may swap such a pair


def assert_greedy_agrees(reference: TPWorker, prompts: list[list[int]], want: list[list[int]],
                         got: list[list[int]], tie: float = BF16_TIE) -> None:
    """`want` came from `reference`; each sequence of `got` equals it, or first parts from it at
    a token whose two candidates the reference (teacher-forced to that point) nearly ties."""
    for prompt, w, g in zip(prompts, want, got, strict=True):
        assert len(w) == len(g), (w, g)
        part = next((j for j, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        if part is None:
            continue
        logits = reference.runner.forward(probe_plan([prompt + w[:part]], 1))[0].float()
        gap = float(logits[w[part]] - logits[g[part]])
        assert gap <= tie, (f"parted at token {part} ({w[part]} against {g[part]}) where the "
                            f"reference's logits are {gap:.3f} apart, not a near tie: {w} {g}")
