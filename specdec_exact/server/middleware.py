"""ASGI middleware of the app, outermost first: Observe (count and time every request, refused ones included),
Authenticate (the API key, checked before anything of the body is read), LimitBody (a body beyond MAX_BODY_BYTES
is refused before the app parses or tokenizes it)."""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import TYPE_CHECKING

from specdec_exact.server.errors import APIError

if TYPE_CHECKING:
    from specdec_exact.server.metrics import Metrics

MAX_BODY_BYTES = 4 * 2**20  # a request body beyond this gets 413 before it is read: far more than any context holds
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")  # metric labels


class Observe:
    """Count requests by endpoint and status, and time them (a stream until its last byte)."""

    def __init__(self, app, metrics: Metrics):
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


def key_digest(key: str) -> bytes:
    """What Authenticate keeps of a key: the SHA-256 digest of the header that carries it. A Ray cluster's front and
    replicas are given these, never the keys (deployment arguments are visible to anyone who can read the cluster's
    state)."""
    return _digest(f"Bearer {key}".encode())


def _digest(header: bytes) -> bytes:
    return hashlib.sha256(header).digest()


class Authenticate:
    """Every route but /health requires `Authorization: Bearer <one of the api keys>`, known by their digests
    (key_digest). It sits outside LimitBody: a client without a key gets 401 from its headers alone, and the server
    never reads or buffers its body. Which key it was (its place in the list) is left in the request's state as `key`
    (the request's tenant, where the server keeps each key's requests apart)."""

    def __init__(self, app, digests: list[bytes]):
        if not digests or not all(len(digest) == hashlib.sha256().digest_size for digest in digests):
            raise ValueError("Authenticate needs at least one key's digest (key_digest)")
        self.app, self.expected = app, list(digests)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = _digest(dict(scope["headers"]).get(b"authorization", b""))
            # every key compared, in constant time each: the time taken says nothing of which one came close
            matches = [secrets.compare_digest(given, expected) for expected in self.expected]
            if not any(matches):
                error = APIError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
            scope.setdefault("state", {})["key"] = matches.index(True)
        await self.app(scope, receive, send)


class LimitBody:
    """A request body larger than max_bytes gets 413, by its Content-Length before anything is read, or as soon as a
    chunked body grows past it; the app never parses or tokenizes such a body."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
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
