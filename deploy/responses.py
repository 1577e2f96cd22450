"""Engine outputs → OpenAI response bodies, whole or as server-sent events.

Logprob token texts come with the outputs (the engine's output processor decodes each token
once); nothing here decodes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from raydix.engine.request import RequestOutput, Usage

from .openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprob,
    UsageInfo,
)
from .tool_calls import ToolDeltas, tool_message
from .tool_parsers import ToolParser

Events = AsyncIterator[tuple[int, RequestOutput]]
Top = tuple[tuple[int, float], ...]  # one position's likeliest tokens: (token id, logprob)


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Top] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    top_token_texts: list[tuple[str, ...]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        self.top_logprobs += out.top_logprobs
        self.token_texts += out.token_texts
        self.top_token_texts += out.top_token_texts
        self.usage = out.usage
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value


@dataclass(frozen=True)
class ResponseHead:
    id: str
    model: str
    n: int  # choices per prompt
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    tool_parser: ToolParser | None = None  # chat with tools: calls parsed out of the text


def usage_info(results: list[ChoiceResult], n: int) -> UsageInfo:
    """The prompt counted once per prompt; the outputs of all choices."""
    prompt = cached = completion = 0
    for i, r in enumerate(results):
        if r.usage is None:
            continue
        completion += r.usage.completion_tokens
        if i % n == 0:
            prompt += r.usage.prompt_tokens
            cached += r.usage.cached_tokens
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _positions(r: ChoiceResult | RequestOutput
               ) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Per output token: its text, its logprob, and its likeliest tokens as (text, logprob)."""
    texts, tops, top_texts = r.token_texts, r.top_logprobs, r.top_token_texts
    if not tops:
        tops, top_texts = [()] * len(texts), [()] * len(texts)
    return [(text, lp, [(alt_text, alt_lp) for alt_text, (_, alt_lp)
                        in zip(alt_texts, top, strict=True)])
            for text, lp, top, alt_texts in zip(texts, r.logprobs, tops, top_texts, strict=True)]


def _completion_logprobs(head: ResponseHead, r: ChoiceResult | RequestOutput,
                         offset: int) -> CompletionLogprobs | None:
    """`logprobs=N`: each position's N likeliest tokens, and the sampled one (as OpenAI's legacy
    API and vLLM); with N = 0 the sampled one alone."""
    if not head.want_logprobs:
        return None
    positions = _positions(r)
    offsets = []
    for text, _, _ in positions:
        offsets.append(offset)
        offset += len(text)
    top_dicts = []
    for text, lp, top in positions:
        alternatives: dict[str, float] = {}
        for alt_text, alt_lp in top:
            alternatives.setdefault(alt_text, alt_lp)
        alternatives.setdefault(text, lp)
        top_dicts.append(alternatives)
    return CompletionLogprobs(tokens=[text for text, _, _ in positions],
                              token_logprobs=list(r.logprobs), top_logprobs=top_dicts,
                              text_offset=offsets)


def _token_logprob(text: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _chat_logprobs(head: ResponseHead, r: ChoiceResult | RequestOutput) -> ChatLogprobs | None:
    if not head.want_logprobs:
        return None
    content = []
    for text, lp, top in _positions(r):
        entry = _token_logprob(text, lp)
        entry.top_logprobs = [_token_logprob(alt_text, alt_lp) for alt_text, alt_lp in top]
        content.append(entry)
    return ChatLogprobs(content=content)


async def collect(events: Events, num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(num_choices)]
    async for i, out in events:
        results[i].add(out)
    return results


def completion_response(head: ResponseHead, results: list[ChoiceResult]) -> CompletionResponse:
    choices = [CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                logprobs=_completion_logprobs(head, r, 0))
               for i, r in enumerate(results)]
    return CompletionResponse(id=head.id, created=head.created, model=head.model,
                              choices=choices, usage=usage_info(results, head.n))


def chat_response(head: ResponseHead, results: list[ChoiceResult]) -> ChatCompletionResponse:
    choices = []
    for i, r in enumerate(results):
        message, reason = ChatResponseMessage(content=r.text), r.finish_reason
        if head.tool_parser is not None:
            message, reason = tool_message(head.tool_parser, r.text, reason)
        choices.append(ChatChoice(index=i, message=message, finish_reason=reason, logprobs=(
            _chat_logprobs(head, r))))
    return ChatCompletionResponse(id=head.id, created=head.created, model=head.model,
                                  choices=choices, usage=usage_info(results, head.n))


def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_none=True)}\n\n"


async def completion_sse(head: ResponseHead, events: Events, num_choices: int,
                         include_usage: bool) -> AsyncIterator[str]:
    results = [ChoiceResult() for _ in range(num_choices)]
    async for i, out in events:
        offset = len(results[i].text)
        results[i].add(out)
        if not out.text and not out.finished and not head.want_logprobs:
            continue
        choice = CompletionChoice(
            index=i, text=out.text,
            finish_reason=out.finish_reason.value if out.finish_reason else None,
            logprobs=_completion_logprobs(head, out, offset))
        yield _sse(CompletionResponse(id=head.id, created=head.created, model=head.model,
                                      choices=[choice]))
    if include_usage:
        yield _sse(CompletionResponse(id=head.id, created=head.created, model=head.model,
                                      choices=[], usage=usage_info(results, head.n)))
    yield "data: [DONE]\n\n"


async def chat_sse(head: ResponseHead, events: Events, num_choices: int,
                   include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return _sse(ChatCompletionChunk(id=head.id, created=head.created, model=head.model,
                                        choices=choices, usage=usage))

    for i in range(num_choices):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    results = [ChoiceResult() for _ in range(num_choices)]
    tools = [ToolDeltas(head.tool_parser) for _ in range(num_choices)] if head.tool_parser else []
    async for i, out in events:
        results[i].add(out)
        content, calls = out.text, None
        reason = out.finish_reason.value if out.finish_reason else None
        if tools:
            content, calls, reason = tools[i].feed(out.text, reason)
        if not content and not calls and not out.finished and not head.want_logprobs:
            continue
        yield chunk([ChatChunkChoice(
            index=i, delta=ChatDelta(content=content if content or not calls else None,
                                     tool_calls=calls),
            finish_reason=reason,
            logprobs=_chat_logprobs(head, out))])
    if include_usage:
        yield chunk([], usage_info(results, head.n))
    yield "data: [DONE]\n\n"
