"""HTTP requests carried from the front to a replica and answered there by the very app `specdec-exact serve` runs.

The front reads a request whole (method, path, headers, body: a ForwardedRequest) and hands it to a replica through
a Ray Serve handle; the replica runs its app on it in-process (answer) and streams back the ASGI messages of the
answer, which the front sends on as they come (Relay). So a replica answers exactly what a single server answers,
errors included, and the routing text of the request (its prompt, or its messages' text) rides along for Ray's
prefix-affinity router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from specdec_exact.server.starting import without_start_up

log = logging.getLogger("specdec.cluster")

RETRIES = 2  # a request whose replica died before answering goes to another replica this many times more


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str  # the text the request starts with: Ray's PrefixCacheAffinityRouter reads the `prompt` attribute

    @classmethod
    def of(cls, scope: dict, body: bytes) -> ForwardedRequest:
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), list(scope["headers"]), body,
                   routing_text(scope["method"], scope["path"], body))

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                "query_string": self.query_string, "headers": self.headers, "client": None, "server": None}


def routing_text(method: str, path: str, body: bytes) -> str:
    """What a request's prompt starts with, as text: a completion's prompt, or the contents of a chat's messages in
    order; for any other request (or a body that is not such JSON) its method and path, which are never empty (Ray's
    router divides by the text's length)."""
    with contextlib.suppress(ValueError, UnicodeError):
        request = json.loads(body) if body else None
        if isinstance(request, dict):
            if isinstance(request.get("messages"), list):
                text = "".join(str(message.get("content", "")) for message in request["messages"]
                               if isinstance(message, dict))
            else:
                text = str(request.get("prompt", ""))
            if text:
                return text
    return f"{method} {path}"


async def answer(app: Callable, request: ForwardedRequest) -> AsyncIterator[dict]:
    """Run the ASGI app on the request here -> the messages it sends: http.response.start, then the body's. When the
    caller stops reading (the client left, or the front went away) the app is told the client disconnected and is
    given a moment to clean up (a request leaves the batch) before it is cancelled."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(request.scope(), receive, messages.put)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task  # the app's own exception, if it raised after answering (a 500 was sent first)
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 5)
            task.cancel()


class Relay:
    """The front's ASGI app: every HTTP request goes whole to a replica (`forward`: a ForwardedRequest -> the async
    iterator of its answer's ASGI messages), and the answer comes back as the replica sends it. A replica that dies
    before its answer has begun is replaced by another for the same request, up to RETRIES times (a generation that
    has not answered can be started again: nothing of it reached the client); one that dies in the middle of a
    stream ends the stream with an error event, which OpenAI clients raise, so a client can retry."""

    def __init__(self, forward: Callable[[ForwardedRequest], AsyncIterator[dict]],
                 replica_lost: tuple[type[BaseException], ...], busy: tuple[type[BaseException], ...]):
        self.forward, self.replica_lost, self.busy = forward, replica_lost, busy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await without_start_up(receive, send)
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:  # the body's size is bounded by LimitBody around this app
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        request = ForwardedRequest.of(scope, b"".join(chunks))
        for attempt in range(RETRIES + 1):
            answer = self.forward(request)
            try:
                start = await answer.__anext__()
            except self.replica_lost as error:
                log.warning("a replica was lost before answering %s %s (%s): %s", request.method, request.path,
                            type(error).__name__, "retrying" if attempt < RETRIES else "giving up")
                continue
            except self.busy:
                return await _error(send, 503, "every replica is busy: retry later", "server_busy")
            break
        else:
            return await _error(send, 503, "the replicas that took this request were lost before answering: retry",
                                "replica_lost")
        await send(start)
        streamed = dict(start.get("headers", [])).get(b"content-type", b"").startswith(b"text/event-stream")
        try:
            async for message in answer:
                await send(message)
        except self.replica_lost as error:
            log.warning("a replica was lost while streaming %s (%s)", request.path, type(error).__name__)
            lost = {"error": {"message": "the replica serving this stream was lost: retry the request",
                              "type": "server_error", "param": None, "code": "replica_lost"}}
            ending = f"data: {json.dumps(lost)}\n\n".encode() if streamed else b""
            await send({"type": "http.response.body", "body": ending, "more_body": False})


async def _error(send, status: int, message: str, code: str) -> None:
    from specdec_exact.server.errors import APIError

    await APIError(status, message, code=code, kind="server_error", headers={"Retry-After": "1"}).response()(
        {"type": "http"}, None, send)
