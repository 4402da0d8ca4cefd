"""A server that binds its port first and loads its models behind it: until the app can serve, /health answers 503
with what is being done and how far it is (specdec_exact.progress), and every other route 503 in OpenAI's shape, so that
a load balancer, an orchestrator or a client sees a starting server rather than a refused connection."""

from __future__ import annotations

import threading
from collections.abc import Callable

from fastapi.responses import JSONResponse

from specdec_exact import progress
from specdec_exact.server.errors import APIError

RETRY_AFTER_S = 5  # what a 503 while starting tells clients to wait before they ask again


class Starting:
    """An ASGI app that answers for `build`'s app while `load` builds it on another thread, then hands every request
    to it. `loaded` is set once the load has ended; `app` is the built app, or `failure` what the load raised."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.app = None
        self.failure: BaseException | None = None
        self.loaded = threading.Event()

    def load(self, build: Callable[[], object], on_failure: Callable[[], None] = lambda: None) -> None:
        """Build the app (on the calling thread), then serve it; what the build raises is kept in `failure` and
        on_failure() is called (a server stops)."""
        try:
            self.app = build()
        except BaseException as error:  # an interrupt too: the server must not wait for an app that never comes
            self.failure = error
            on_failure()
        finally:
            self.loaded.set()

    def start(self, build: Callable[[], object], on_failure: Callable[[], None] = lambda: None) -> threading.Thread:
        """load(build, on_failure) on a thread of its own, started -> the thread."""
        thread = threading.Thread(target=self.load, args=(build, on_failure), name="specdec-load", daemon=True)
        thread.start()
        return thread

    def state(self) -> dict:
        """/health's body while starting: "calibrating" while a calibration runs, else "loading", and the progress."""
        now = progress.current()
        calibrating = any(step["step"].startswith("calibrating") for step in now["steps"])
        return {"status": "calibrating" if calibrating else "loading", "model": self.model_name, "progress": now}

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "lifespan":  # (the built app is handed requests only: it has no start-up of its own)
            return await without_start_up(receive, send)
        if scope["type"] != "http":
            return
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if scope["path"] == "/health":
            response = JSONResponse(self.state(), status_code=503, headers=retry)
        else:
            state = self.state()
            steps = state["progress"]["steps"]
            doing = f" ({steps[-1]['step']})" if steps else ""
            response = APIError(503, f"the server is starting{doing}: retry once /health answers 200",
                                code="server_starting", kind="server_error", headers=retry).response()
        await response(scope, receive, send)


async def without_start_up(receive, send) -> None:
    """ASGI's lifespan protocol for an app with nothing to start or stop: each step acknowledged as done."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            return await send({"type": "lifespan.shutdown.complete"})
