"""Structured output on the driving rank: grammars compiled by xgrammar (once per grammar,
cached, on a background thread) and one matcher per request row, whose token bitmask the
sampler applies to the logits.

Names load on first use: the HTTP edge checks grammars (`check_grammar`) without loading torch,
which only the matchers' table needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"GrammarCompiler": "compiler", "check_grammar": "compiler", "GrammarTable": "table"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
