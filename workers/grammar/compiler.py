"""Grammars compiled once per `GrammarSpec`, off the step: a request's grammar starts compiling
when the engine first sees it (`prefetch`), on one background thread, and the step that admits
the request only waits for what is left of it. Compiled grammars are kept, least recently used
out first.

`check_grammar` builds a spec's grammar without a tokenizer: what the HTTP edge calls to refuse
a bad schema, regex or EBNF before anything is queued.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..step import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED_GRAMMARS = 256


def check_grammar(spec: GrammarSpec) -> None:
    """Raise ValueError naming the problem when `spec` is not a grammar xgrammar can build."""
    import xgrammar as xgr

    if spec.kind in ("json_schema", "structural_tag"):
        try:
            json.loads(spec.source)
        except json.JSONDecodeError as e:
            raise ValueError(f"the {spec.kind.replace('_', ' ')} is not valid JSON: {e}") from None
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.source)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.source)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {_message(e)}") from None


def _message(error: BaseException) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.strip()


class GrammarCompiler:
    """Compiles grammars for one model's tokenizer (loaded on first use)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydix-grammar")
        self._lock = threading.Lock()
        self._futures: OrderedDict[GrammarSpec, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._compiler: xgrammar.GrammarCompiler | None = None  # made on the pool's thread

    def prefetch(self, spec: GrammarSpec) -> Future[xgrammar.CompiledGrammar]:
        """Start compiling `spec` unless it is compiled or compiling; its future."""
        with self._lock:
            future = self._futures.get(spec)
            if future is not None:
                self._futures.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._futures[spec] = future
            while len(self._futures) > self.max_cached:
                self._futures.popitem(last=False)
            return future

    def get(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar, waiting for its compilation if it is not done yet."""
        future = self.prefetch(spec)
        try:
            return future.result()
        except Exception:
            with self._lock:  # a failed compile is not kept: the next request tries again
                if self._futures.get(spec) is future:
                    del self._futures[spec]
            raise

    @property
    def num_cached(self) -> int:
        return len(self._futures)

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.source, any_whitespace=False,
                                                strict_mode=True)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.source)
        return compiler.compile_structural_tag(spec.source)

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids))
            # xgrammar keeps its own cache too; ours holds the futures
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
