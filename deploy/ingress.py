"""The OpenAI-compatible HTTP ingress (FastAPI through `serve.ingress`).

It checks the API key and the body size, validates the body, tokenizes (the chat template for
chat), checks the context limit, starts one engine request per choice and answers whole or as
server-sent events ending with `data: [DONE]`. Every refusal is an OpenAI error body.
"""


import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from raydix.cluster.actor_heap import freeze_actor_heap
from raydix.engine.request import GenerationParams
from raydix.router.priority import take_normal_priority
from raydix.workers.step import GrammarSpec

if TYPE_CHECKING:
    from .server import EngineServer
    from .stats_board import StatsBoard

from .engine_ingress import HostsEngine, LocalEngine, LocalEngineHandle, start_engine_server
from .errors import ApiError, bad_request, from_validation_error, too_large, unauthorized
from .generation import ChoiceStreams, make_choices
from .metrics import IngressMetrics, render_metrics
from .openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from .request_params import RequestLimits, generation_params, token_ids
from .responses import (
    ResponseHead,
    chat_response,
    chat_sse,
    collect,
    completion_response,
    completion_sse,
)
from .serve_env import local_handle
from .structured import checked_grammar, requested_grammar
from .tool_calls import ToolPlan, chat_messages, plan_tools
from .tool_parsers import ToolParser, parser_for

B = TypeVar("B", bound=BaseModel)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

logger = logging.getLogger(__name__)
app = FastAPI(title="raydix", docs_url=None, redoc_url=None)


async def _guard_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE chunks through. A failure after the stream began becomes an error event (the
    status line is sent already); a client that went away closes the source at once, which
    aborts the engine requests."""
    try:
        async for chunk in chunks:
            yield chunk
    except ApiError as e:  # e.g. the engine replica was lost: a known failure, named
        logger.warning("a stream failed: %s", e.message)
        body = ErrorResponse(error=ErrorInfo(message=f"the stream failed: {e.message}",
                                             type=e.type, code=e.code))
        yield f"data: {body.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as e:
        logger.exception("a stream failed")
        body = ErrorResponse(error=ErrorInfo(message=f"the stream failed: {e}",
                                             type="server_error", code="stream_failed"))
        yield f"data: {body.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


@app.exception_handler(ApiError)
async def _api_error(_: Request, error: ApiError) -> JSONResponse:
    return error.response()


@app.exception_handler(Exception)
async def _server_error(_: Request, error: Exception) -> JSONResponse:
    logger.exception("a request failed")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}",
                    type="server_error", code="internal_error").response()


@serve.ingress(app)
class OpenAIIngress(HostsEngine):
    def __init__(self, engine: "DeploymentHandle[EngineServer] | None",
                 stats_board: "DeploymentHandle[StatsBoard] | None",
                 model_path: str, model_name: str, max_context_len: int,
                 max_request_bytes: int, api_key: str | None = None,
                 cache_aware_router: bool = False, schedule_policy: str = "fcfs",
                 tool_call_parser: str = "auto", tokenizer: Any = None,
                 local_engine: LocalEngine | None = None) -> None:
        """`tokenizer`: the model's tokenizer as the app's builder loaded it (AutoTokenizer),
        handed over pickled: unpickling needs only transformers' tokenizer classes, where
        loading with AutoTokenizer here would import torch (about 4 s of CPU and 300 MB in a
        replica that computes nothing). Without it the folder's tokenizer is loaded here.
        `local_engine` (with `engine` None): this replica is the engine replica too
        (`engine_ingress.py`), and /metrics reads its stats here unless a `stats_board` is
        given (the engine deployment's replicas report to the board)."""
        take_normal_priority("the ingress")  # every request and token passes here (priority.py)
        self.stats_board = local_handle(stats_board) if stats_board is not None else None
        self.engine: Any
        if local_engine is not None:
            self.engine_server = start_engine_server(local_engine, stats_board)
            self.engine = LocalEngineHandle(self.engine_server)
        elif engine is not None and stats_board is not None:
            self.engine = local_handle(engine)
        else:
            raise ValueError("the ingress needs a local engine, or the engine deployment's "
                             "handle and the stats board")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer = tokenizer
        self.tool_parser = parser_for(tool_call_parser, self.tokenizer.chat_template)
        self.model_name = model_name
        self.max_context_len = max_context_len
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key
        self.created = int(time.time())
        self.metrics = IngressMetrics()
        self.cache_aware_router = cache_aware_router
        self.limits = RequestLimits(max_context_len, schedule_policy, len(self.tokenizer))
        freeze_actor_heap("the ingress")

    # ------------------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health(self) -> dict[str, str]:
        try:
            await self.engine.ping.remote()
        except Exception as e:
            raise ApiError(503, f"the engine is not available: {e}", type="server_error",
                           code="engine_unavailable", headers={"Retry-After": "5"}) from e
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(self) -> PlainTextResponse:
        if self.stats_board is not None:
            stats = await self.stats_board.snapshot.remote()
        else:  # the one engine replica is this one
            stats = [await self.stats()]
        router_stats = await self._router_stats() if self.cache_aware_router else None
        return PlainTextResponse(render_metrics(self.metrics, stats, router_stats),
                                 media_type="text/plain; version=0.0.4")

    async def _router_stats(self) -> dict[str, float] | None:
        """The router actor's decision latency and per-replica hit rates; None while it is
        not reachable (it is made by the first engine replica)."""
        import ray

        from raydix.router.actor import get_router

        try:
            app_name = serve.get_replica_context().app_name
            actor = await asyncio.to_thread(get_router, app_name)  # a GCS lookup: off the loop
            stats: dict[str, float] = await asyncio.wait_for(actor.stats.remote(), 5.0)
        except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError) as e:
            logger.debug("no router stats: %r", e)
            return None
        return stats

    @app.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        self._check_auth(request)
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.max_context_len)])

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        start = time.perf_counter()  # the request's clock (time to first token, latency)
        with self.metrics.count_errors("completions"):
            return await self._completions(request, start)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        start = time.perf_counter()
        with self.metrics.count_errors("chat_completions"):
            return await self._chat_completions(request, start)

    async def _completions(self, request: Request, start: float) -> Response:
        self._check_auth(request)
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        prompts = self._completion_prompts(body.prompt)
        max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        params = self._params(body, prompts, max_tokens, ("prompt", "max_tokens"),
                              body.logprobs is not None, body.logprobs or 0,
                              await self._grammar(body))
        return await self._generate("cmpl", body, prompts, params, start, chat=False)

    async def _chat_completions(self, request: Request, start: float) -> Response:
        self._check_auth(request)
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        tools = plan_tools(body, self.tool_parser)
        prompt = self._chat_prompt(body, tools)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_context_len - len(prompt), 1)
        limit_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        grammar = await self._grammar(body)
        if tools is not None and tools.grammar is not None:
            if grammar is not None:
                raise bad_request("a constrained output can't be combined with tools (unless "
                                  "tool_choice is none)", "tool_choice")
            grammar = await checked_grammar(tools.grammar, "tools")
        params = self._params(body, [prompt], max_tokens, ("messages", limit_field),
                              body.logprobs, body.top_logprobs or 0, grammar)
        return await self._generate("chatcmpl", body, [prompt], params, start, chat=True,
                                    tool_parser=tools.parser if tools is not None else None)

    # ------------------------------------------------------------------------- pipeline
    async def _generate(self, kind: str, body: CompletionRequest | ChatCompletionRequest,
                        prompts: list[list[int]], params: GenerationParams, start: float,
                        chat: bool, tool_parser: ToolParser | None = None) -> Response:
        request_id = f"{kind}-{uuid.uuid4().hex}"
        choices = make_choices(request_id, prompts, params, body.n)
        head = ResponseHead(id=request_id, model=self.model_name, n=body.n,
                            want_logprobs=params.sampling.return_logprob,
                            tool_parser=tool_parser)
        track = self.metrics.track(chat, start)
        streams = ChoiceStreams(self.engine, choices)
        await streams.start()
        events = track.watch(streams.events())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            sse = chat_sse if chat else completion_sse
            return StreamingResponse(_guard_stream(sse(head, events, len(choices), include_usage)),
                                     media_type="text/event-stream")
        results = await collect(events, len(choices))
        answer = chat_response(head, results) if chat else completion_response(head, results)
        return JSONResponse(answer.model_dump(exclude_none=True))

    def _params(self, body: CompletionRequest | ChatCompletionRequest,
                prompts: list[list[int]], max_tokens: int, fields: tuple[str, str],
                logprobs: bool, top_logprobs: int,
                grammar: GrammarSpec | None = None) -> GenerationParams:
        return generation_params(body, prompts, max_tokens, fields, logprobs, top_logprobs,
                                 grammar, self.limits)

    async def _grammar(self, body: CompletionRequest | ChatCompletionRequest
                       ) -> GrammarSpec | None:
        asked = requested_grammar(body)
        return None if asked is None else await checked_grammar(*asked)

    def _completion_prompts(self, prompt: str | list[str] | list[int]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(token_ids([int(t) for t in prompt], "prompt", self.limits.vocab_size))]
        prompts = [self.tokenizer.encode(str(p)) for p in prompt]
        if any(not p for p in prompts):
            raise bad_request("the prompt is empty", "prompt")
        return prompts

    def _chat_prompt(self, body: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        messages, template_tools = chat_messages(body.messages, tools,
                                                 self.tokenizer.chat_template)
        text = self.tokenizer.apply_chat_template(messages, tools=template_tools,
                                                  add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    # ----------------------------------------------------------------------- edge checks
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise unauthorized()

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise bad_request(f"the model {model!r} is not served here; this server serves "
                              f"{self.model_name!r}", "model", code="model_not_found")

    async def _parse(self, request: Request, model: type[B]) -> B:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise too_large(self.max_request_bytes)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_request_bytes:
                raise too_large(self.max_request_bytes)
        try:
            return model.model_validate_json(bytes(raw))
        except ValidationError as e:
            raise from_validation_error(e) from e

