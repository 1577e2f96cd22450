"""A request's sampling settings and its grammar, as the step plan carries them to the driving
rank (`step.py` re-exports them). numpy-free and torch-free: the HTTP ingress builds them."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output, compiled by xgrammar on the driving rank.

    `kind`: "json_schema" (`source` is the schema as JSON text), "json_object" (any JSON
    object; `source` is empty), "regex", "ebnf" (xgrammar's EBNF, root rule `root`) or
    "structural_tag" (an xgrammar structural tag as JSON text, e.g. tool calls)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` or `top_k == 1` is greedy."""

    temperature: float = 1.0
    top_k: int = -1  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # same seed + same prompt -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    return_logprob: bool = False  # logprob of the chosen token under the raw distribution
    top_logprobs: int = 0  # also the likeliest tokens and their logprobs, this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    banned_token_ids: tuple[int, ...] = ()  # never sampled (the engine's min_new_tokens)
    # OpenAI's: logits -= frequency * count + presence * (count > 0), counts over the output
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # transformers' and vLLM's: over prompt and output tokens, logits > 0 are divided by it and
    # the others multiplied
    repetition_penalty: float = 1.0
    grammar: GrammarSpec | None = None  # the output follows it; its end ends the request

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0)


GREEDY = SamplingParams(temperature=0.0)
