"""Count the operators a forward dispatches, per decoder layer: a torch dispatch mode records
each operator that launches work (views and other metadata-only operators are left out), and
forward hooks on the model's layers say which layer it ran in.

A `raydix::` operator of the fused-op seam counts once whatever its kernel does inside (the
mode does not see into it), as its flashinfer kernel is one launch on CUDA. So with the fused
ops selected, a census taken on the CPU counts the steps the CUDA path launches; the GEMMs
count once each as they do there. The GPU's own kernel count (torch.profiler over a graph
replay) is benchmarks/kernel_count.py's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# operators that launch nothing: allocation and metadata. Operators whose schema lets their
# output alias the input (views, and `to` / `contiguous`, which copy only when they must) count
# when their output is in fact new memory.
_NO_WORK = {"aten.empty_like", "aten.empty", "aten.empty_strided", "aten.lift_fresh",
            "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.is_same_size"}


@dataclass
class OpCensus:
    """`layers[i]`: operator name -> count in decoder layer i; `outside`: the rest."""

    layers: list[Counter[str]] = field(default_factory=list)
    outside: Counter[str] = field(default_factory=Counter)

    def per_layer(self) -> list[int]:
        return [sum(c.values()) for c in self.layers]

    @property
    def total(self) -> int:
        return sum(self.per_layer()) + sum(self.outside.values())


class _Recorder(TorchDispatchMode):
    def __init__(self, census: OpCensus) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.census = census
        self.layer: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        out = func(*args, **(kwargs or {}))
        if name in _NO_WORK or (getattr(func, "is_view", False) and _aliases(out, args)):
            return out
        where = self.census.outside if self.layer is None else self.census.layers[self.layer]
        where[name] += 1
        return out


def _aliases(out: Any, args: Any) -> bool:
    """Every tensor `out` holds lives in the storage of a tensor argument."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (tuple, list)) else [out]
    return all(o.untyped_storage().data_ptr() in inputs for o in outs
               if isinstance(o, torch.Tensor))


@contextmanager
def op_census(layers: nn.ModuleList) -> Iterator[OpCensus]:
    """Record the operators dispatched inside the block, attributed to `layers`' indices."""
    census = OpCensus(layers=[Counter() for _ in layers])
    recorder = _Recorder(census)
    hooks = []

    def enter(i: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            recorder.layer = i
        return hook

    def leave(*_: object) -> None:
        recorder.layer = None

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(enter(i)))
        hooks.append(layer.register_forward_hook(leave))
    try:
        with recorder:
            yield census
    finally:
        for h in hooks:
            h.remove()


def describe(census: OpCensus) -> str:
    """One line per distinct layer census, for logs and assertion messages."""
    lines = [f"outside the layers: {sum(census.outside.values())} "
             f"{dict(sorted(census.outside.items()))}"]
    for i, c in enumerate(census.layers):
        lines.append(f"layer {i}: {sum(c.values())} {dict(sorted(c.items()))}")
    return "\n".join(lines)
