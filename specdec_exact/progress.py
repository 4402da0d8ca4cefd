"""Progress of the long steps (setting up, calibrating, loading): each step logs what it does, how far it is and
its ETA through `logging` (logger "specdec.progress"), shows a bar on a terminal, and is readable while it runs by
whoever waits for it (a starting server's /health: `current()`).

    with progress.step("kernels per pass width for model.gguf", total=5, unit="round") as step:
        for _ in range(5):
            ...
            step.advance()
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger("specdec.progress")

LOG_EVERY_S = 10.0  # a running step logs how far it is at most this often (each advance is shown on a terminal's bar)


@dataclass
class Step:
    """One step under way: what it does and, where it knows its total, how far it is."""

    what: str
    total: int | None = None
    unit: str = "step"
    done: int = 0
    started: float = field(default_factory=lambda: time.monotonic())
    _logged: float = field(default_factory=lambda: time.monotonic(), repr=False)
    _bar: object = field(default=None, repr=False)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def eta_s(self) -> float | None:
        """Seconds left, from the pace so far (None until a first unit is done, or without a total)."""
        if not self.total or not self.done:
            return None
        return self.elapsed_s / self.done * max(0, self.total - self.done)

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S and (self.total is None or self.done < self.total):
            self._logged = now
            log.info("%s: %s", self.what, self.describe())

    def describe(self) -> str:
        """'3/5 rounds, 40 s so far, about 27 s left'."""
        count = f"{self.done}/{self.total} {self.unit}s" if self.total else f"{self.done} {self.unit}s"
        eta = self.eta_s
        return f"{count}, {self.elapsed_s:.0f} s so far" + ("" if eta is None else f", about {eta:.0f} s left")

    def as_dict(self) -> dict:
        eta = self.eta_s
        return {"step": self.what, "done": self.done, "total": self.total, "unit": self.unit,
                "elapsed_s": round(self.elapsed_s, 1), "eta_s": None if eta is None else round(eta, 1)}


_lock = threading.Lock()
_running: list[Step] = []  # the steps under way in this process, outermost first
_finished = 0  # steps finished in this process


@contextlib.contextmanager
def step(what: str, total: int | None = None, unit: str = "step") -> Iterator[Step]:
    """A long step: logged when it starts and ends (and every LOG_EVERY_S as it advances), a bar on a terminal, and
    `current()` while it runs. What it raises is logged as its failure and raised on."""
    global _finished
    progress = Step(what, total, unit)
    if total and sys.stderr.isatty():
        from tqdm import tqdm

        progress._bar = tqdm(total=total, desc=what, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True)
    log.info("%s ...", what)
    with _lock:
        _running.append(progress)
    try:
        yield progress
    except GeneratorExit:  # a loop over each() that stopped early: the step ends there
        log.info("%s: done in %.0f s", what, progress.elapsed_s)
        raise
    except BaseException as error:
        log.warning("%s: stopped after %.0f s (%s)", what, progress.elapsed_s, type(error).__name__)
        raise
    else:
        log.info("%s: done in %.0f s", what, progress.elapsed_s)
    finally:
        if progress._bar is not None:
            progress._bar.close()
        with _lock:
            _running.remove(progress)
            _finished += 1


def each(items, what: str, unit: str = "step") -> Iterator:
    """The items, as one step that advances with each (a loop that stops early ends the step there)."""
    items = list(items)
    with step(what, len(items), unit) as running:
        for item in items:
            yield item
            running.advance()


def current() -> dict:
    """What this process is doing: {"steps": the steps under way, outermost first (Step.as_dict), "finished": how
    many steps have finished}."""
    with _lock:
        return {"steps": [running.as_dict() for running in _running], "finished": _finished}


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever sys.stderr is when a record comes (a redirected or captured stream too)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def log_to_stderr(level: int = logging.INFO) -> None:
    """Show specdec's log on stderr, as the command line does: the time and the message (once per process)."""
    logger = logging.getLogger("specdec")
    if not any(isinstance(handler, _Stderr) for handler in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s specdec: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level)
