"""Structured output on the driving rank: grammars compiled by xgrammar (once per grammar,
cached, on a background thread) and one matcher per request row, whose token bitmask the
sampler applies to the logits."""

from .compiler import GrammarCompiler, check_grammar
from .table import GrammarTable

__all__ = ["GrammarCompiler", "GrammarTable", "check_grammar"]
