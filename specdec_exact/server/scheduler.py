"""Continuous batching for the server: one thread runs the model, each cycle a step of every active request
(batching.Batch: their target passes fused) after one prefill pass of a request still reading its prompt (chunked
prefill: a long prompt holds the others up one pass at a time, and can be cancelled or time out between passes);
requests join between cycles while the batch has room and leave when they finish, fail, time out or their client
leaves. A request's place in it is a Ticket (its chunks arrive on an
asyncio queue); a route reads them through a Turn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from specdec_exact.batching import Batch, Generation
from specdec_exact.requests import ContextLengthExceeded
from specdec_exact.runtimes.base import before_next_pass
from specdec_exact.server.errors import APIError, generation_failed

if TYPE_CHECKING:
    from starlette.requests import Request

    from specdec_exact.generator import SpeculativeGenerator
    from specdec_exact.metrics import SpecStats
    from specdec_exact.output import Chunk
    from specdec_exact.requests import Request as GenerationRequest

log = logging.getLogger("specdec.server.scheduler")

DEFAULT_MAX_QUEUE = 32  # requests that may wait while the batch is full; one more gets 503
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a request queued or generating this long ends with 504 and leaves the batch
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there


class Ticket:
    """A request in the scheduler, the asyncio queue its chunks arrive on (filled from the model's thread), and the
    time (time.perf_counter) by which it must have finished, if any."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, deadline: float | None,
                 timeout: float | None):
        self.request, self.loop, self.deadline, self.timeout = request, loop, deadline, timeout
        self.generation: Generation | None = None  # once the request has joined the batch
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def push(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed (the server stopped): nobody is left to read it
            pass

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.perf_counter() if now is None else now) >= self.deadline

    def timed_out(self) -> APIError:
        return APIError(504, f"the request did not finish within the server's request timeout of {self.timeout:g} s "
                             "(--request-timeout): ask for fewer tokens, or retry when the server is less busy",
                        code="request_timeout", kind="server_error")


class Scheduler:
    """Continuous batching: one thread runs the model, each cycle a step of every active request (batching.Batch:
    their target passes fused); requests join between cycles, one per cycle while the batch has room, and leave when
    they finish, fail, time out or their client leaves. Up to max_queue more wait; beyond that a request gets 503 at
    once. A failure that is one request's ends that request alone; one of the batch as a whole ends the requests in
    it, and the thread goes on serving the next."""

    def __init__(self, generator: SpeculativeGenerator, max_batch: int, max_queue: int, max_length: int | None = None,
                 request_timeout: float | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        self.batch, self.max_queue = Batch(generator, max_batch, max_length), max_queue
        self.request_timeout = request_timeout
        self._waiting: deque[Ticket] = deque()
        self._active: dict[Generation, Ticket] = {}
        # A cycle's chunks that do not end their request go to the event loop when the next pass starts (_send): the
        # loop's work on them then overlaps that pass. Handed over at once, each woke the loop, which then held the
        # interpreter while the model's thread prepared the next pass and made it wait (outside the passes 1.11 ms a
        # token served, 0.66 ms handed over at the next pass: AMD EPYC Zen 4, 2 cores, docs/served-overhead-zen4).
        self._outgoing: list[tuple[Ticket, Chunk]] = []
        self._starting = 0  # requests taken from the queue and not yet in the batch
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._died: str | None = None  # what ended the model's thread, if it ended
        self.faults = 0  # faults of the model's thread outside a batch step, each ending the requests in flight

    @property
    def pending(self) -> int:
        """Requests generating or waiting to."""
        return len(self._waiting) + self._starting + len(self._active)

    @property
    def occupancy(self) -> int:
        """Requests in the batch now."""
        return len(self._active)

    @property
    def healthy(self) -> bool:
        """Whether the model's thread runs (or has not been needed yet). A fault it survives (outside a batch step:
        in a prefill, a request leaving) ends the requests in flight and leaves it running; if it ends anyway, the
        next request starts it again."""
        return self._thread is None or self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the model's thread is not running (None while it is, or has not been needed yet)."""
        if self.healthy:
            return None
        return self._died or "the model's thread ended"

    def submit(self, request: GenerationRequest, arrived: float) -> Ticket:
        """Queue a request that arrived at `arrived` (time.perf_counter); its request timeout counts from then."""
        deadline = arrived + self.request_timeout if self.request_timeout is not None else None
        ticket = Ticket(request, asyncio.get_running_loop(), deadline, self.request_timeout)
        with self._changed:
            if len(self._waiting) >= self.max_queue and self.pending >= self.batch.max_batch:
                raise APIError(503, f"the server is busy: {len(self._waiting)} requests are already waiting for the "
                                    "model; retry later", code="server_busy", kind="server_error",
                               headers={"Retry-After": "1"})
            self._waiting.append(ticket)
            if self._thread is None or not self._thread.is_alive():  # first use, or it died: (re)start it
                if self._thread is not None:
                    log.error("the model's thread had ended (%s): starting it again", self.failure)
                self._thread = threading.Thread(target=self._run, name="specdec-model", daemon=True)
                self._thread.start()
            self._changed.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client left: a waiting request leaves the queue now, an active one the batch before the next cycle."""
        with self._changed:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)

    def _run(self) -> None:
        """The model's thread: cycle after cycle. A fault outside a batch step ends every request in flight with it
        (none is left waiting for a thread that no longer serves it) and the thread goes on."""
        try:
            while True:
                try:
                    self._cycle()
                except Exception as error:
                    log.exception("the model's thread failed outside a batch step: the requests in flight end")
                    self.faults += 1
                    self._fail_in_flight(error, waiting=False)
        except BaseException as error:  # not an Exception: the thread ends; its requests must not wait forever
            self._died = f"the model's thread ended: {type(error).__name__}"
            self._fail_in_flight(error, waiting=True)
            raise

    def _fail_in_flight(self, error: BaseException, waiting: bool) -> None:
        """End every request in the batch with error (a failure of the server, not of any one request), and the
        waiting ones too if the thread is ending (the next request starts a new one)."""
        failure = error if isinstance(error, Exception) else RuntimeError(f"the model's thread ended: {error!r}")
        self._send()
        with self._changed:
            tickets = list(self._active.values())
            for generation in list(self._active):
                with contextlib.suppress(Exception):  # what failed may be this very bookkeeping
                    self.batch.drop(generation)
            self._active.clear()
            self._starting = 0
            if waiting:
                tickets += self._waiting
                self._waiting.clear()
        for ticket in tickets:
            ticket.push(failure)

    def _cycle(self) -> None:
        """One cycle: requests leave and join (waiting for one if there is none), then a step of every active one."""
        with self._changed:
            if not self._waiting and not self._active:
                self._send()  # (before waiting: nothing else would)
            while not self._waiting and not self._active:
                self._changed.wait()
            self._leave()
            # One request joins per cycle; its prompt is read a pass per cycle (Batch.step), the earliest first,
            # so the requests already decoding go on while prompts are read.
            joining = [self._waiting.popleft()] if self._waiting and self.batch.has_room() else []
            self._starting = len(joining)
        for ticket in joining:  # outside the lock, so that requests keep arriving meanwhile
            self._start(ticket)
            with self._changed:
                self._starting -= 1
        try:
            outcomes = self.batch.step()  # a request that fails ends alone, with its error
        except Exception as error:  # a failure of the batch itself, not of one request: it ends them all
            log.exception("a batch cycle failed: the requests in it end")
            outcomes = self._end_all(error)
        else:
            for _, outcome in outcomes:
                if isinstance(outcome, Exception):
                    log.error("a request failed", exc_info=outcome)
        for generation, outcome in outcomes:
            ticket = self._active[generation]
            if isinstance(outcome, Exception) or outcome.finish_reason:
                del self._active[generation]
                self._send()  # (a request's chunks in order)
                ticket.push(outcome)
            else:
                self._outgoing.append((ticket, outcome))
        before_next_pass(self._send if self._outgoing else None)
        self.batch.keep_answers()  # after the finished answers are out: their clients do not wait for it

    def _send(self) -> None:
        """Hand the chunks kept back to their requests' event loops."""
        outgoing, self._outgoing = self._outgoing, []
        for ticket, chunk in outgoing:
            ticket.push(chunk)

    def _leave(self) -> None:
        """Before a cycle (under the lock): requests whose client left leave the batch, and requests past their
        deadline leave the batch or the queue with their timeout error."""
        now = time.perf_counter()
        for generation, ticket in list(self._active.items()):
            if ticket.cancelled or ticket.expired(now):
                self._send()  # (a request's chunks before its timeout)
                self.batch.drop(generation)
                del self._active[generation]
                if not ticket.cancelled:
                    ticket.push(ticket.timed_out())
        for ticket in [t for t in self._waiting if t.expired(now)]:
            self._waiting.remove(ticket)
            ticket.push(ticket.timed_out())

    def _end_all(self, error: Exception) -> list[tuple[Generation, Exception]]:
        for generation in list(self._active):
            self.batch.drop(generation)
        return [(generation, error) for generation in self._active]

    def _start(self, ticket: Ticket) -> None:
        try:
            generation = ticket.generation = self.batch.add(ticket.request)
        except ContextLengthExceeded as error:  # the request's own fault (checked when it was built, too)
            ticket.push(APIError(400, str(error), code="context_length_exceeded"))
        except Exception as error:
            log.exception("a request failed to start")
            ticket.push(error)
        else:
            if generation.last is not None:
                ticket.push(generation.last)
            else:
                self._active[generation] = ticket


class Turn:
    """A request's place in the scheduler, read chunk by chunk. close() ends it (the scheduler drops it before its next
    cycle) and is safe to call more than once or after the last chunk."""

    def __init__(self, scheduler: Scheduler, ticket: Ticket, on_first: Callable[[], None],
                 on_last: Callable[[SpecStats], None]):
        self._scheduler, self._ticket, self._on_first, self._on_last = scheduler, ticket, on_first, on_last
        self._started = self._finished = False

    async def next(self, request: Request | None = None) -> Chunk | None:
        """The next chunk; None after the last one, or when the client of `request` left while it waited. Raises the
        request's error as an APIError (what to answer with): its refusal, its failure (errors.generation_failed), or
        its timeout once its deadline passes while it waits."""
        if self._finished:
            return None
        item = await self._wait(request)
        if item is None:
            return None
        if isinstance(item, Exception):
            self.close()
            if isinstance(item, APIError):
                raise item
            raise generation_failed(item) from item
        if not self._started:
            self._started = True
            self._on_first()
        if item.finish_reason:
            self._finished = True
            self._on_last(item.stats)
        return item

    async def _wait(self, request: Request | None):
        queue, ticket = self._ticket.queue, self._ticket
        while queue.empty():
            wait = DISCONNECT_POLL_S if request is not None else None
            if ticket.deadline is not None:
                left = ticket.deadline - time.perf_counter()
                wait = left if wait is None else min(wait, left)
            try:
                return await asyncio.wait_for(queue.get(), max(wait, 0.0) if wait is not None else None)
            except asyncio.TimeoutError:
                if ticket.expired():  # (even while the model's thread is busy with one long cycle)
                    return ticket.timed_out()
                if request is not None and await request.is_disconnected():
                    self.close()
                    return None
        return queue.get_nowait()

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._scheduler.cancel(self._ticket)
            if self._started and self._ticket.generation is not None:  # an aborted generation's tokens count too
                self._on_last(self._ticket.generation.stats)
