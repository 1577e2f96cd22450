"""OpenAI request and response bodies (the subset raydix serves), as pydantic models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a last chunk carrying the usage")


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", description="the schema's name")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema")
    strict: bool | None = Field(None, description="the output follows the schema exactly")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _GrammarFields(_Body):
    """Structured output: OpenAI's `response_format`, and vLLM's and SGLang's own fields."""

    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema")
    guided_json: str | dict[str, Any] | None = Field(None, description="a JSON schema")
    guided_regex: str | None = Field(None, description="a regular expression")
    guided_choice: list[str] | None = Field(None, description="one of these strings")
    guided_grammar: str | None = Field(None, description="an EBNF grammar (root rule: root)")
    regex: str | None = Field(None, description="a regular expression")
    ebnf: str | None = Field(None, description="an EBNF grammar (root rule: root)")


class _SamplingFields(_GrammarFields):
    model: str = Field(description="the served model's name")
    max_tokens: int | None = Field(None, gt=0, description="output tokens at most")
    min_tokens: int = Field(0, ge=0, description="no EOS or stop token id before this many")
    temperature: float = Field(1.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(-1, description="sample among the k likeliest tokens; <= 0: off")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens below min_p x the top one")
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="minus this x the times a token is in the output"
    )
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="minus this for a token already in the output"
    )
    repetition_penalty: float = Field(
        1.0, gt=0, description="scales down tokens of the prompt and output (1: off)"
    )
    stop: str | list[str] | None = Field(None, description="stop strings (not in the output)")
    stop_token_ids: list[int] | None = Field(None, description="token ids that also stop")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> added to its logit, in [-100, 100]"
    )
    seed: int | None = Field(None, description="same seed, same prompt: same tokens")
    n: int = Field(1, ge=1, le=16, description="choices per prompt")
    stream: bool = Field(False, description="server-sent events, ending with [DONE]")
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="keep going past end-of-sequence tokens")
    priority: int = Field(
        0, ge=-(2**31), le=2**31 - 1,
        description="larger runs earlier; only when the server's schedule policy is priority",
    )
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256,
        description="prefix-cache namespace: a request reuses cached prefixes only of requests "
        "with the same salt (none shares only with unsalted ones)",
    )
    user: str | None = Field(None, description="ignored")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] = Field(
        description="a text, a list of texts, or one prompt as token ids"
    )
    logprobs: int | None = Field(
        None, ge=0, le=5,
        description="return the sampled tokens' logprobs and the likeliest this many per position"
    )
    echo: Literal[False] = Field(False, description="not supported: must be false")


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's tool calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(description="the conversation so far")
    max_completion_tokens: int | None = Field(None, gt=0, description="alias of max_tokens")
    logprobs: bool = Field(False, description="return the sampled tokens' logprobs")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="the likeliest this many tokens per position (logprobs on)"
    )
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or one function")
    parallel_tool_calls: bool | None = Field(None, description="more than one call at once")


# ------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TokenLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = []


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "raydix"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
