"""A request body's sampling fields -> the engine's `GenerationParams`, each checked by name.

Every field the engine cannot honour as asked is refused with an OpenAI error naming it.
"""

from __future__ import annotations

from typing import NamedTuple

from raydix.engine.request import GenerationParams
from raydix.workers.step import GrammarSpec, SamplingParams

from .errors import bad_request
from .openai_schema import ChatCompletionRequest, CompletionRequest


class RequestLimits(NamedTuple):
    """What the served model and server allow."""

    max_context_len: int
    schedule_policy: str
    vocab_size: int


def generation_params(body: CompletionRequest | ChatCompletionRequest,
                      prompts: list[list[int]], max_tokens: int, fields: tuple[str, str],
                      logprobs: bool, top_logprobs: int, grammar: GrammarSpec | None,
                      limits: RequestLimits) -> GenerationParams:
    """Check the context limit (`fields`: the names of the prompt and of the output
    limit, for the error) and build the engine's parameters."""
    prompt_field, limit_field = fields
    longest = max(len(p) for p in prompts)
    if longest >= limits.max_context_len:
        raise bad_request(f"the prompt has {longest} tokens; this model's maximum context "
                          f"length is {limits.max_context_len} tokens", prompt_field,
                          code="context_length_exceeded")
    if longest + max_tokens > limits.max_context_len:
        raise bad_request(
            f"this model's maximum context length is {limits.max_context_len} tokens, but "
            f"{longest + max_tokens} were requested ({longest} in the prompt, {max_tokens} "
            f"for the output); lower {limit_field}", limit_field,
            code="context_length_exceeded")
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) is more than {limit_field} "
                          f"({max_tokens})", "min_tokens")
    if grammar is not None and body.min_tokens:
        raise bad_request("min_tokens can't be combined with a constrained output: the "
                          "grammar decides where the output ends", "min_tokens")
    if body.priority and limits.schedule_policy != "priority":
        raise bad_request(f"priority is used only under the priority schedule policy; this "
                          f"server schedules by {limits.schedule_policy!r} "
                          "(start it with --schedule-policy priority)", "priority")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop strings must not be empty", "stop")
    sampling = SamplingParams(logit_bias=logit_bias(body.logit_bias, limits.vocab_size),
                              stop_token_ids=token_ids(body.stop_token_ids or [],
                                                        "stop_token_ids", limits.vocab_size),
                              temperature=body.temperature, top_k=body.top_k,
                              top_p=body.top_p, min_p=body.min_p, seed=body.seed,
                              return_logprob=logprobs, top_logprobs=top_logprobs,
                              frequency_penalty=body.frequency_penalty,
                              presence_penalty=body.presence_penalty,
                              repetition_penalty=body.repetition_penalty,
                              grammar=grammar)
    return GenerationParams(sampling=sampling, max_new_tokens=max_tokens,
                            min_new_tokens=body.min_tokens,
                            stop_strings=tuple(stop), ignore_eos=body.ignore_eos,
                            priority=body.priority, extra_key=body.cache_salt)


def token_ids(ids: list[int], field: str, vocab: int) -> tuple[int, ...]:
    """`ids` checked against the vocabulary (`field` names them in the error)."""
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"{field} must be token ids in [0, {vocab})", field)
    return tuple(ids)

def logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    try:
        ids = [int(k) for k in bias]
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
    if any(not -100.0 <= v <= 100.0 for v in bias.values()):
        raise bad_request("logit_bias values must be in [-100, 100]", "logit_bias")
    return tuple(zip(token_ids(ids, "logit_bias", vocab), bias.values(), strict=True))
