"""OpenAI-compatible HTTP server over one SpeculativeGenerator (`specdec serve`).

Endpoints: POST /v1/completions and POST /v1/chat/completions (`stream: true` answers with server-sent events),
GET /v1/models, GET /health, GET /metrics (Prometheus text format).

Requests are decoded in a batch (continuous batching): one thread runs the model, each cycle a step of every active
request, their target passes fused (generator.Batch); a request joins between cycles while the batch has room
(--max-batch) and leaves when it finishes or its client leaves, and what it generates does not depend on the others.
The event loop keeps answering (health, metrics, new requests) meanwhile. Requests waiting for room form a bounded
queue: while max_queue are waiting, a new one gets 503; a client that leaves while waiting leaves the queue.

Responses carry OpenAI's fields plus `specdec`: the request's speculation stats (SpecStats.to_dict(): drafted and
accepted tokens, acceptance rate, mean accepted length, ...). A stream carries them on its last chunk before
`data: [DONE]`, which is the usage chunk (`choices: []`) when `stream_options.include_usage` asks for one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, AsyncIterator, Callable, Iterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from specdec.batching import Batch, Generation
from specdec.generator import DEFAULT_MAX_BATCH
from specdec.options import add_generation_args, generator_from_args
from specdec.requests import ContextLengthExceeded

if TYPE_CHECKING:
    from specdec.generator import SpeculativeGenerator
    from specdec.metrics import SpecStats
    from specdec.output import Chunk
    from specdec.requests import Request as GenerationRequest

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 32  # requests that may wait while the batch is full; one more gets 503
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there
MAX_BODY_BYTES = 4 * 2**20  # a request body beyond this gets 413 before it is read: far more than any context holds
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the context has left
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")  # metric labels

# OpenAI options this server does not implement, with the values that leave them off: others are refused, not ignored.
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0),
               "frequency_penalty": (None, 0), "tools": (None, []), "functions": (None, []),
               "response_format": (None, {"type": "text"})}


# ---- request bodies: strict types ("16" is not a number), unknown fields kept so unsupported ones can be refused

class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range; None -> 1.0, OpenAI's default; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)  # not OpenAI's; accepted as vLLM does
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what a torch.Generator takes
    n: int | None = None  # only 1
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    return_token_ids: bool | None = None  # not OpenAI's: as vLLM, each choice also carries its "token_ids"


class CompletionBody(_Body):
    prompt: str | list[int]  # text, or token ids of the target's vocabulary


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name for max_tokens


# ---- errors, in OpenAI's shape

class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}, like OpenAI's."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = (
            status, message, param, code, kind, headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(error: RequestValidationError) -> APIError:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
    where = [str(part) for part in first["loc"] if part != "body"]
    message = f"{'.'.join(where)}: {first['msg']}" if where else f"the request body: {first['msg']}"
    return APIError(400, message, where[0] if where else None)


# ---- the scheduler (continuous batching) and a request's turn

class _Ticket:
    """A request in the scheduler, and the asyncio queue its chunks arrive on (filled from the model's thread)."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.generation: Generation | None = None  # once the request has joined the batch
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class _Scheduler:
    """Continuous batching: one thread runs the model, each cycle a step of every active request (generator.Batch:
    their target passes fused); requests join between cycles, one per cycle while the batch has room, and leave when
    they finish or their client leaves. Up to max_queue more wait; beyond that a request gets 503 at once."""

    def __init__(self, generator: SpeculativeGenerator, max_batch: int, max_queue: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.batch, self.max_queue = Batch(generator, max_batch), max_queue
        self._waiting: deque[_Ticket] = deque()
        self._active: dict[Generation, _Ticket] = {}
        self._starting = 0  # requests taken from the queue whose prefill is running
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Requests generating or waiting to."""
        return len(self._waiting) + self._starting + len(self._active)

    @property
    def occupancy(self) -> int:
        """Requests in the batch now."""
        return len(self._active)

    def submit(self, request: GenerationRequest) -> _Ticket:
        ticket = _Ticket(request, asyncio.get_running_loop())
        with self._changed:
            if len(self._waiting) >= self.max_queue and self.pending >= self.batch.max_batch:
                raise APIError(503, f"the server is busy: {len(self._waiting)} requests are already waiting for the "
                                    "model; retry later", code="server_busy", kind="server_error",
                               headers={"Retry-After": "1"})
            self._waiting.append(ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specdec-model", daemon=True)
                self._thread.start()
            self._changed.notify()
        return ticket

    def cancel(self, ticket: _Ticket) -> None:
        """The client left: a waiting request leaves the queue now, an active one the batch before the next cycle."""
        with self._changed:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._waiting and not self._active:
                    self._changed.wait()
                for generation, ticket in list(self._active.items()):
                    if ticket.cancelled:
                        self.batch.drop(generation)
                        del self._active[generation]
                # One request joins per cycle: the requests already decoding go on while prompts are read, and a
                # new request's first token comes with the cycle right after its prefill, not after every prefill.
                joining = [self._waiting.popleft()] if self._waiting and self.batch.has_room() else []
                self._starting = len(joining)
            for ticket in joining:  # the prefill: outside the lock, so that requests keep arriving meanwhile
                self._start(ticket)
                with self._changed:
                    self._starting -= 1
            for generation, outcome in self.batch.step():  # a request that fails ends alone, with its error
                ticket = self._active[generation]
                if isinstance(outcome, Exception):
                    log.error("a request failed", exc_info=outcome)
                    ticket.push(outcome)
                    del self._active[generation]
                    continue
                ticket.push(outcome)
                if outcome.finish_reason:
                    del self._active[generation]

    def _start(self, ticket: _Ticket) -> None:
        try:
            generation = ticket.generation = self.batch.add(ticket.request)
        except ValueError as error:  # the model refuses the request (prompt too long, ...)
            ticket.push(APIError(400, str(error)))
        except Exception as error:
            log.exception("a request failed to start")
            ticket.push(error)
        else:
            if generation.last is not None:
                ticket.push(generation.last)
            else:
                self._active[generation] = ticket


class _Turn:
    """A request's place in the scheduler, read chunk by chunk. close() ends it (the scheduler drops it before its next
    cycle) and is safe to call more than once or after the last chunk."""

    def __init__(self, scheduler: _Scheduler, ticket: _Ticket, on_first: Callable[[], None],
                 on_last: Callable[[SpecStats], None]):
        self._scheduler, self._ticket, self._on_first, self._on_last = scheduler, ticket, on_first, on_last
        self._started = self._finished = False

    async def next(self, request: Request | None = None) -> Chunk | None:
        """The next chunk; None after the last one, or when the client of `request` left while it waited."""
        if self._finished:
            return None
        while True:
            try:
                item = await asyncio.wait_for(self._ticket.queue.get(), DISCONNECT_POLL_S if request else None)
                break
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.close()
                    return None
        if isinstance(item, Exception):
            self._finished = True
            raise item
        if not self._started:
            self._started = True
            self._on_first()
        if item.finish_reason:
            self._finished = True
            self._on_last(item.stats)
        return item

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._scheduler.cancel(self._ticket)
            if self._started and self._ticket.generation is not None:  # an aborted generation's tokens count too
                self._on_last(self._ticket.generation.stats)


class _TurnStream(StreamingResponse):
    """Server-sent events that free the model when the response ends, however it ends: finished, client gone (the body
    cancelled mid-cycle or left waiting at a yield), or never started."""

    def __init__(self, events: AsyncIterator[str], turn: _Turn):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.turn = turn

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.turn.close()


# ---- response bodies

@dataclass
class _Reply:
    """The response bodies of one request, in its endpoint's shape."""
    chat: bool
    model: str
    prompt_tokens: int
    with_token_ids: bool = False  # each choice carries the ids of its tokens (return_token_ids)
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def usage(self, stats: SpecStats) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": stats.new_tokens,
                "total_tokens": self.prompt_tokens + stats.new_tokens}

    def whole(self, text: str, token_ids: list[int], last: Chunk) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        if self.with_token_ids:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice],
                              usage=self.usage(last.stats), specdec=last.stats.to_dict())

    def piece(self, chunk: Chunk, first: bool, with_stats: bool) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": chunk.text} if first else {"content": chunk.text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": chunk.finish_reason}
        else:
            choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": chunk.finish_reason}
        if self.with_token_ids:
            choice["token_ids"] = chunk.token_ids
        extra = {"specdec": chunk.stats.to_dict()} if with_stats else {}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_piece(self, stats: SpecStats) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=self.usage(stats), specdec=stats.to_dict())


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _events(turn: _Turn, first: Chunk, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
    """One event per generator Chunk, the usage chunk if asked for, then [DONE]. An error mid-stream (the status line
    is already sent) becomes an error event, as OpenAI sends it."""
    chunk, is_first = first, True
    try:
        while chunk is not None:
            last = chunk.finish_reason is not None
            yield _event(reply.piece(chunk, is_first, with_stats=last and not include_usage))
            if last:
                if include_usage:
                    yield _event(reply.usage_piece(chunk.stats))
                break
            chunk, is_first = await turn.next(), False
    except APIError as error:
        yield _event(error.body())
        return
    except Exception:
        log.exception("generation failed mid-stream")
        yield _event(APIError(500, "generation failed", kind="server_error").body())
        return
    yield "data: [DONE]\n\n"


# ---- metrics

class _Metrics:
    """Prometheus metrics of one app, in its own registry (several apps may live in one process, as in the tests)."""

    def __init__(self, queue_depth: Callable[[], int], occupancy: Callable[[], int]):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.latency = Histogram("specdec_request_latency_seconds", "Request latency, a stream until its last byte",
                                 ["endpoint"], registry=registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft = Histogram("specdec_time_to_first_token_seconds",
                              "From arrival (queueing included) to the first cycle's tokens", ["endpoint"],
                              registry=registry, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished generations",
                                     registry=registry)
        self.completion_tokens = Counter("specdec_completion_tokens", "Tokens generated", registry=registry)
        self.drafted = Counter("specdec_drafted_tokens", "Draft tokens proposed", registry=registry)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted by the target", registry=registry)
        self.cycles = Counter("specdec_verify_cycles", "Verify cycles (mean accepted length = "
                              "(accepted + cycles) / cycles)", registry=registry)
        self._totals = [0, 0]  # drafted, accepted: for the acceptance-rate gauge
        Gauge("specdec_acceptance_rate", "Accepted / drafted tokens over all generations so far",
              registry=registry).set_function(lambda: self._totals[1] / self._totals[0] if self._totals[0] else 0.0)
        Gauge("specdec_queue_depth", "Requests generating or waiting for the model",
              registry=registry).set_function(queue_depth)
        Gauge("specdec_batch_occupancy", "Requests in the batch being decoded now",
              registry=registry).set_function(occupancy)
        self.request_acceptance = Histogram("specdec_request_acceptance_rate",
                                            "Per request: accepted / drafted tokens (requests that drafted)",
                                            registry=registry, buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1))

    def observe_generation(self, prompt_tokens: int, stats: SpecStats) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.cycles.inc(stats.cycles)
        self._totals[0] += stats.drafted_tokens
        self._totals[1] += stats.accepted_tokens
        if stats.drafted_tokens:
            self.request_acceptance.observe(stats.accepted_tokens / stats.drafted_tokens)


class _Observe:
    """ASGI middleware: count requests by endpoint and status, and time them (a stream until its last byte)."""

    def __init__(self, app, metrics: _Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status, started = 500, time.perf_counter()  # 500 unless a response starts: the app raised

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)


class _LimitBody:
    """ASGI middleware: a request body larger than max_bytes gets 413, by its Content-Length before anything is read,
    or as soon as a chunked body grows past it; the app never parses or tokenizes such a body."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        # No Content-Length (a chunked body): read it here, up to the limit, then hand it on whole.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await APIError(413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large").response()(
            {"type": "http"}, None, send)


class _Authenticate:
    """ASGI middleware: every route but /health requires `Authorization: Bearer <api key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


# ---- the app

class _Service:
    """What the routes share: the generator, the scheduler, the metrics."""

    def __init__(self, generator: SpeculativeGenerator, model_name: str, max_batch: int, max_queue: int):
        self.generator, self.model_name = generator, model_name
        self.scheduler = _Scheduler(generator, max_batch, max_queue)
        self.context = self.scheduler.batch.max_length  # tokens one request holds, prompt and completion
        self.metrics = _Metrics(lambda: self.scheduler.pending, lambda: self.scheduler.occupancy)
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specdec"}

    def check(self, body: _Body) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"the model `{body.model}` does not exist: this server serves `{self.model_name}`",
                           "model", "model_not_found")
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (got {body.n}): this server returns one choice per request", "n")
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")

    async def build(self, body: _Body, prompt, chat: bool, max_tokens: int | None, param: str) -> GenerationRequest:
        """The request, built and checked by the generator in a worker thread (the chat template and the tokenizer
        are blocking work: the event loop keeps answering meanwhile). max_tokens None: what the context has room for.
        A request that cannot fit in a sequence's context is refused here, with what to change."""
        settings = dict(temperature=1.0 if body.temperature is None else body.temperature, top_k=body.top_k,
                        top_p=body.top_p, seed=body.seed,
                        stop=[body.stop] if isinstance(body.stop, str) else body.stop or [])
        try:
            return await run_in_threadpool(self.generator.request, prompt, max_tokens, chat=chat,
                                           max_length=self.context, **settings)
        except ContextLengthExceeded as error:
            raise APIError(400, str(error), param if error.prompt_too_long else "max_tokens",
                           "context_length_exceeded") from error
        except (ValueError, TypeError, UnicodeError) as error:  # TypeError: text the tokenizer cannot take
            raise APIError(400, f"the {param} cannot be used: {error}", param) from error

    async def respond(self, request: Request, body: _Body, generation: GenerationRequest, chat: bool,
                      started: float) -> Response:
        endpoint = request.url.path
        n_prompt = len(generation.prompt_ids)
        reply = _Reply(chat, self.model_name, n_prompt, bool(body.return_token_ids))
        turn = _Turn(self.scheduler, self.scheduler.submit(generation),
                     on_first=lambda: self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - started),
                     on_last=lambda stats: self.metrics.observe_generation(n_prompt, stats))
        try:
            first = await turn.next(request)  # waits in the queue; a bad request is refused here, while a 400 can be sent
        except BaseException:
            turn.close()
            raise
        if first is None:  # the client left while the request waited
            return Response(status_code=499)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _TurnStream(_events(turn, first, reply, include_usage), turn)
        texts, token_ids, last = [first.text], list(first.token_ids), first
        try:
            while last.finish_reason is None:
                chunk = await turn.next(request)
                if chunk is None or (chunk.finish_reason is None and await request.is_disconnected()):
                    return Response(status_code=499)  # the client left: the scheduler drops it before its next cycle
                texts.append(chunk.text)
                token_ids += chunk.token_ids
                last = chunk
        finally:
            turn.close()
        return JSONResponse(reply.whole("".join(texts), token_ids, last))


def create_app(generator: SpeculativeGenerator, model_name: str, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_batch: int = DEFAULT_MAX_BATCH) -> FastAPI:
    """An OpenAI-compatible app serving `generator` under `model_name` (the `model` clients must send)."""
    service = _Service(generator, model_name, max_batch, max_queue)
    app = FastAPI(title="specdec", summary="Exact speculative decoding behind an OpenAI-compatible API")
    app.state.service = service
    if api_key:
        app.add_middleware(_Authenticate, api_key=api_key)
    app.add_middleware(_LimitBody, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(_Observe, metrics=service.metrics)  # added last: outermost, so it counts 401s and 413s too

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> Response:
        return _validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> Response:
        return APIError(500, f"internal error: {type(error).__name__}", kind="server_error").response()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        started = time.perf_counter()
        service.check(body)
        max_tokens = COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        generation = await service.build(body, body.prompt, False, max_tokens, "prompt")
        return await service.respond(request, body, generation, chat=False, started=started)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        started = time.perf_counter()
        service.check(body)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        messages = [message.as_template_input() for message in body.messages]
        generation = await service.build(body, messages, True, requested, "messages")
        return await service.respond(request, body, generation, chat=True, started=started)

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
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "pending": service.scheduler.pending,
                "batch": service.scheduler.occupancy, "cross_vocabulary": service.generator.cross_vocabulary}

    @app.get("/v1/specdec/plan")
    async def kernel_plan() -> dict:
        """Which kernels the models run their passes with (runtimes.llamacpp.kernels), as the calibration chose them."""
        return {"kernel_plans": generator.kernel_plans()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# ---- `specdec serve`

def add_serve_parser(subparsers) -> None:

    parser = subparsers.add_parser("serve", help="serve the models over an OpenAI-compatible HTTP API")
    add_generation_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                        help="require `Authorization: Bearer KEY` on every route but /health "
                             "(default: $SPECDEC_API_KEY, else no key)")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                        help="requests decoded together, their target passes fused; 1 serves one at a time with "
                             "the full drafter, a draft model included (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait while the batch is full; more get 503 (default: %(default)s)")
    parser.add_argument("--model-name", default=None,
                        help="the `model` clients send (default: the --target value)")
    parser.set_defaults(func=run_serve)


def run_serve(args) -> int:
    import uvicorn


    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    generator = generator_from_args(args)  # loaded once, shared by every request
    app = create_app(generator, args.model_name or args.target, args.api_key, args.max_queue, args.max_batch)
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"specdec: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port)
    return 0
