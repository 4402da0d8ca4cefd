"""The app: create_app() puts the routes, their error handlers and the middleware around one Service, which holds
what the routes share (the generator, the scheduler, the metrics) and turns a request body into a generation
request and its answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from specdec_exact import grammar
from specdec_exact.generator import DEFAULT_MAX_BATCH
from specdec_exact.requests import ContextLengthExceeded
from specdec_exact.tools import ToolFormat, tool_format
from specdec_exact.vocabulary import TokenText
from specdec_exact.server.bodies import Body, ChatBody, CompletionBody, NamedToolChoice
from specdec_exact.server.errors import APIError, internal_error, validation_error
from specdec_exact.server.limits import available_memory, choose_ctx_size
from specdec_exact.server.metrics import Metrics
from specdec_exact.server.middleware import MAX_BODY_BYTES, Authenticate, LimitBody, Observe, key_digest
from specdec_exact.server.replies import Answer, Reply, TurnStream, events
from specdec_exact.server.scheduler import DEFAULT_MAX_QUEUE, DEFAULT_REQUEST_TIMEOUT_S, Scheduler, Turn

if TYPE_CHECKING:
    from specdec_exact.generator import SpeculativeGenerator
    from specdec_exact.output import Chunk
    from specdec_exact.requests import Request as GenerationRequest

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the context has left


class Service:
    """What the routes share: the generator, the scheduler, the metrics, and the context one request holds.

    tenants: each API key's requests draw only on that key's earlier ones (the prompt cache, the suffix lookup's
    history), so that no client can learn from a cache hit, a time to first token or a draft's acceptance what another
    key's clients sent or were answered; False: every request draws on all earlier ones."""

    def __init__(self, generator: SpeculativeGenerator, model_name: str, max_batch: int, max_queue: int,
                 ctx_size: int, request_timeout: float | None, tenants: bool = False):
        self.generator, self.model_name, self.tenants = generator, model_name, tenants
        self.scheduler = Scheduler(generator, max_batch, max_queue, ctx_size, request_timeout)
        self.context = self.scheduler.batch.max_length  # tokens one request holds, prompt and completion
        self.metrics = Metrics(self.scheduler, generator.prompt_cache)
        self.created = int(time.time())
        self.token_text = TokenText(generator.tokenizer)  # each token's bytes and text, as logprobs show them
        template = getattr(generator.tokenizer, "chat_template", None)
        self.tool_format = tool_format(template if isinstance(template, str) else None)
        self.added_tokens = frozenset(token.content for token in
                                      getattr(generator.tokenizer, "added_tokens_decoder", {}).values())

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specdec",
                "max_model_len": self.context}  # vLLM's name for the tokens a request may hold

    def check(self, body: Body) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"the model `{body.model}` does not exist: this server serves `{self.model_name}`",
                           "model", "model_not_found")
        if isinstance(body, ChatBody) and body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if body.n not in (None, 1) and body.stream:
            raise APIError(400, f"n = {body.n} is answered whole: send it without stream, or n = 1", "n")
        unsupported = body.unsupported()
        if unsupported:
            raise APIError(400, f"{unsupported} is not supported by this server", unsupported,
                           "unsupported_parameter")

    def tenant(self, request: Request) -> str | None:
        """Whose earlier requests this one may draw on: its API key's (Authenticate), where keys are kept apart."""
        key = getattr(request.state, "key", None)
        return f"key {key}" if self.tenants and key is not None else None

    def tools_of(self, body: ChatBody) -> tuple[list[dict] | None, ToolFormat | None, grammar.Grammar | None]:
        """A chat request's tools -> (the tools for the chat template; the format to read calls from the answer in,
        None where no call is to be read (tool_choice "none"); the grammar of a required call, or None)."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools: offer them in `tools`", "tool_choice")
            return None, None, None
        if self.tool_format is None:
            raise APIError(400, "this model's chat template offers it no tools (or has it write calls in a format "
                                "this server does not read): send the request without tools", "tools")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
        if choice == "none":
            return tools, None, None
        forced = None
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if body.response_format and body.response_format.get("type", "text") != "text":
                raise APIError(400, "a required tool call and a response_format cannot both shape the answer",
                               "tool_choice")
            only = choice.function.name if isinstance(choice, NamedToolChoice) else None
            try:
                forced = self.tool_format.grammar(tools, only, body.parallel_tool_calls is not False,
                                                  self.added_tokens)
            except grammar.GrammarError as error:
                raise APIError(400, str(error), "tool_choice") from error
        return tools, self.tool_format, forced

    async def build(self, body: Body, prompt, chat: bool, max_tokens: int | None, param: str,
                    tenant: str | None = None, tools: list[dict] | None = None,
                    forced: grammar.Grammar | None = None) -> GenerationRequest:
        """The request, built and checked by the generator in a worker thread (the chat template and the tokenizer
        are blocking work: the event loop keeps answering meanwhile). max_tokens None: what the context has room for.
        A request that cannot fit in the context (--ctx-size) is refused here, with what to change. tenant: whose
        earlier requests it may draw on (Service.tenant); tools, forced: its tools for the chat template and the
        grammar of a required call (tools_of)."""
        try:
            adjust = body.adjust()
            if adjust is not None:
                adjust.check_vocab(self.generator.vocab_size)
        except ValueError as error:
            raise APIError(400, str(error), "logit_bias") from error
        try:
            constrained = forced or (grammar.schema_of(body.response_format) if body.response_format else None)
        except grammar.GrammarError as error:
            raise APIError(400, str(error), "response_format") from error
        settings = dict(temperature=1.0 if body.temperature is None else body.temperature, top_k=body.top_k,
                        top_p=body.top_p, seed=body.seed,
                        stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
                        logprobs=body.logprobs_asked(), adjust=adjust, grammar=constrained)
        try:
            return await run_in_threadpool(self.generator.request, prompt, max_tokens, chat=chat,
                                           max_length=self.context, tenant=tenant, tools=tools, **settings)
        except ContextLengthExceeded as error:
            raise APIError(400, str(error), param if error.prompt_too_long else "max_tokens",
                           "context_length_exceeded") from error
        except grammar.GrammarError as error:
            raise APIError(400, str(error), "response_format") from error
        except (ValueError, TypeError, UnicodeError) as error:  # TypeError: text the tokenizer cannot take
            raise APIError(400, f"the {param} cannot be used: {error}", param) from error

    async def echo(self, body: CompletionBody, generation: GenerationRequest) -> tuple[str, list | None]:
        """A completion's prompt as echo gives it back: its text and, with logprobs, its tokens' (computed in a
        worker thread, in passes of their own: SpeculativeGenerator.prompt_logprobs)."""
        ids = list(generation.prompt_ids)
        text = body.prompt if isinstance(body.prompt, str) else self.generator.tokenizer.decode(ids)
        if body.logprobs is None:
            return text, None
        return text, await run_in_threadpool(self.generator.prompt_logprobs, ids, body.logprobs)

    async def respond(self, request: Request, body: Body, generation: GenerationRequest, chat: bool,
                      started: float, tools: ToolFormat | None = None, echo: tuple | None = None) -> Response:
        """Queue the request (its timeout counting from `started`, its arrival) and answer it: whole, or as a stream
        once its first chunk has come (until then an error can still be answered with its status)."""
        endpoint = request.url.path
        n_prompt = len(generation.prompt_ids)
        reply = Reply(chat, self.model_name, n_prompt, bool(body.return_token_ids),
                      bool(body.return_speculation_stats),
                      self.token_text if generation.logprobs is not None else None, tools)
        def submit(one: GenerationRequest) -> Turn:
            return Turn(self.scheduler, self.scheduler.submit(one, started),
                        on_first=lambda: self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - started),
                        on_last=lambda stats: self.metrics.observe_generation(n_prompt, stats))

        turns = [submit(generation)]
        try:
            first = await turns[0].next(request)  # waits in the queue; a refusal comes here, while its status can go
        except BaseException:
            turns[0].close()
            raise
        if first is not None and body.stream:  # (the stream frees its turn however it ends)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return TurnStream(events(turns[0], first, reply, include_usage), turns[0])
        try:
            if first is None:  # the client left while the request waited
                return Response(status_code=499)
            # n > 1: the other choices start once the first has read the prompt, so that they take it from the
            # prompt cache; choice i samples with seed + i (as generate_many), and greedy choices are all the same
            turns += [submit(replace(generation, seed=None if generation.seed is None else generation.seed + i))
                      for i in range(1, body.n or 1)]
            answers = await asyncio.gather(self._collect(turns[0], request, first),
                                           *(self._collect(turn, request) for turn in turns[1:]))
        finally:
            for turn in turns:
                turn.close()
        if any(answer is None for answer in answers):
            return Response(status_code=499)  # the client left: the scheduler drops it before its next cycle
        return JSONResponse(reply.whole(answers, echo))

    @staticmethod
    async def _collect(turn: Turn, request: Request, first: Chunk | None = None) -> Answer | None:
        """A turn's chunks gathered into its whole answer (None: the client left)."""
        chunk = first if first is not None else await turn.next(request)
        if chunk is None:
            return None
        texts, token_ids, logprobs, last = [chunk.text], list(chunk.token_ids), list(chunk.logprobs or []), chunk
        while last.finish_reason is None:
            chunk = await turn.next(request)
            if chunk is None or (chunk.finish_reason is None and await request.is_disconnected()):
                return None
            texts.append(chunk.text)
            token_ids += chunk.token_ids
            logprobs += chunk.logprobs or []
            last = chunk
        return Answer("".join(texts), token_ids, last, logprobs if last.logprobs is not None else None)


def create_app(generator: SpeculativeGenerator, model_name: str, api_key: str | Sequence[str] | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_batch: int = DEFAULT_MAX_BATCH, ctx_size: int | None = None,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S, share_across_keys: bool = False,
               key_digests: Sequence[bytes] = ()) -> FastAPI:
    """An OpenAI-compatible app serving `generator` under `model_name` (the `model` clients must send).

    api_key: the key, or keys, of which every route but /health needs one (None or none: no key asked for). With
    several, each key's requests draw only on that key's earlier ones (the prompt cache, the lookup history: Service),
    unless share_across_keys. key_digests: more keys, known only by their digests (middleware.key_digest), after
    api_key's (how a Ray cluster's replicas are given the keys).

    ctx_size: the tokens one request may hold, prompt and completion (default: what memory allows, limits.
    choose_ctx_size); a ctx_size or max_batch whose KV caches cannot fit is refused here (ValueError).
    request_timeout: seconds a request may be queued and generating before it ends with 504 (None: no limit).
    """
    ctx_size = choose_ctx_size(ctx_size, kv_bytes_per_token=generator.kv_bytes_per_token(),
                               trained_context=generator.context_length, max_batch=max_batch,
                               available_bytes=available_memory(),
                               prompt_cache_bytes=generator.prompt_cache.budget_bytes if generator.prompt_cache else 0)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if not all(keys):
        raise ValueError("an API key cannot be empty")
    digests = [key_digest(key) for key in keys] + list(key_digests)
    service = Service(generator, model_name, max_batch, max_queue, ctx_size, request_timeout,
                      tenants=len(digests) > 1 and not share_across_keys)
    app = FastAPI(title="specdec", summary="Exact speculative decoding behind an OpenAI-compatible API")
    app.state.service = service
    # Added innermost first: Observe(Authenticate(LimitBody(app))), so that a client without the key is refused
    # before its body is read, and 401s and 413s are counted too.
    app.add_middleware(LimitBody, max_bytes=MAX_BODY_BYTES)
    if digests:
        app.add_middleware(Authenticate, digests=digests)
    app.add_middleware(Observe, metrics=service.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> Response:
        return validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> Response:
        return internal_error(error, "internal error").response()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        started = time.perf_counter()
        service.check(body)
        max_tokens = COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        if body.echo and body.stream:
            raise APIError(400, "echo is answered whole: send it without stream", "echo")
        generation = await service.build(body, body.prompt, False, max_tokens, "prompt", service.tenant(request))
        echo = await service.echo(body, generation) if body.echo else None
        return await service.respond(request, body, generation, chat=False, started=started, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        started = time.perf_counter()
        service.check(body)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        messages = [message.as_template_input() for message in body.messages]
        tools, calls, forced = service.tools_of(body)
        generation = await service.build(body, messages, True, requested, "messages", service.tenant(request),
                                         tools, forced)
        return await service.respond(request, body, generation, chat=True, started=started, tools=calls)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{model:path}")  # model names may hold slashes: Qwen/Qwen2.5-0.5B-Instruct
    async def get_model(model: str) -> dict:
        if model != model_name:
            raise APIError(404, f"the model `{model}` does not exist: this server serves `{model_name}`", "model",
                           "model_not_found")
        return service.model_card()

    @app.get("/health")
    async def health() -> Response:
        """200 "ok" while the model can serve; 503 "error" with the reason while it cannot (its thread ended: the
        next request starts it again)."""
        scheduler = service.scheduler
        state = {"status": "ok", "model": model_name, "pending": scheduler.pending, "batch": scheduler.occupancy,
                 "cross_vocabulary": service.generator.cross_vocabulary}
        if scheduler.failure is not None:
            return JSONResponse({**state, "status": "error", "reason": scheduler.failure}, status_code=503)
        return JSONResponse(state)

    @app.get("/v1/specdec/plan")
    async def kernel_plan() -> dict:
        """Which kernels the models run their passes with (runtimes.llamacpp.kernels), as the calibration chose them."""
        return {"kernel_plans": generator.kernel_plans()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
