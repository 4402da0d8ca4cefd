"""What specdec asks of a runtime, and the objects a runtime answers with.

A runtime loads models and gives each loaded model's sequences (SequencePool -> Runner). What only some runtimes can
do, they answer with an object, others with None: the measured costs of passes (PassCosts), fused passes over several
sequences that stay exact (Batching). Callers ask the runtime (`runtime_of(model).costs(model)`), never the model's
attributes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generator, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from specdec_exact.prompt_cache import PromptCache


class Runner(Protocol):
    """One sequence of a model: forward over new tokens with a KV cache, and roll back."""

    vocab_size: int  # logits are cut to this many tokens (the vocabulary shared by target and drafter)
    max_length: int  # tokens this sequence may hold
    pool: SequencePool | None  # the pool it came from, whose forward_many can take it with its other sequences
    prompt_tokens_reused: int  # tokens of its prompt (its first forward) taken from a prompt cache, not computed
    prompt_cache_s: float  # seconds that prefill spent on the prompt cache's bookkeeping (0.0 without one)

    @property
    def length(self) -> int:
        """Number of tokens held in the cache."""

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append input_ids [1, n] to the cache -> logits [1, n or 1, vocab_size] (float32)."""

    def rollback(self, length: int) -> None:
        """Drop cache entries past `length` tokens."""

    def verify_width(self, length: int) -> int | None:
        """The widest pass whose logits equal one-token passes bit for bit after `length` cached tokens; the engine
        never verifies more tokens at once. None: no limit."""

    def close(self) -> None:
        """The sequence is over: its slot goes back to its pool."""

    # Optional: prefill(input_ids) -> a generator that evaluates a new sequence's prompt pass by pass, yielding
    # between passes (so that other sequences may run theirs), whose value is forward(input_ids, last_only=True)'s.
    # Runners without it prefill in one forward (see prefill below).


T = TypeVar("T")

_next_pass = threading.local()


def before_next_pass(callback: Callable[[], None] | None) -> None:
    """Run callback once, in this thread, just before its next model pass starts (None: nothing). A pass lets other
    Python threads run while it computes: the server hands the last cycle's chunks to its event loop then, so that
    the loop's work on them overlaps the pass rather than holding up this thread's own Python (server.scheduler)."""
    _next_pass.callback = callback


def pass_starts() -> None:
    """A model pass is about to start in this thread (every runtime calls it): the callback set for it runs, once."""
    callback = getattr(_next_pass, "callback", None)
    if callback is not None:
        _next_pass.callback = None
        callback()


def prefill(runner: Runner, prompt_ids: torch.Tensor) -> Generator[None, None, torch.Tensor]:
    """A new sequence's prompt [1, n], pass by pass where its runner can pause between passes (its prefill method),
    else in one forward; the generator's value is the last token's logits [1, 1, vocab]."""
    if hasattr(runner, "prefill"):
        return (yield from runner.prefill(prompt_ids))
    return runner.forward(prompt_ids, last_only=True)


def run_through(steps: Generator[None, None, T]) -> T:
    """Run a pass-by-pass generator (prefill) to its end -> its value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


class SequencePool(Protocol):
    """Where a model's sequences come from: a runtime's pool hands out runners and evaluates several at once."""

    max_length: int  # tokens one sequence may hold

    @property
    def free(self) -> int:
        """Sequences take() can start now."""

    def take(self, vocab_size: int, tenant: str | None = None) -> Runner:
        """A new, empty sequence; where the runtime caches prompts, it reuses and caches them for this tenant's
        sequences alone (None: the sequences without a tenant)."""

    def forward_many(self, items: list[tuple[Runner, torch.Tensor]]) -> list[torch.Tensor]:
        """Each runner's logits for its tokens [1, n] -> [1, n, vocab], as runner.forward would give them (in one
        pass where the runtime fuses them)."""


@dataclass(frozen=True)
class PassCosts:
    """Seconds of a pass over w tokens of one sequence after a short context, measured on this machine."""

    pass_s: dict[int, float]  # width -> seconds; width 1 present

    @property
    def step_s(self) -> float:
        """Seconds of a one-token pass."""
        return self.pass_s[1]

    @property
    def verify_slope(self) -> float:
        """Extra cost per extra token of a pass, in one-token passes (0: flat, 1: linear): the median slope."""
        slopes = sorted((s / self.step_s - 1) / (w - 1) for w, s in self.pass_s.items() if w > 1)
        return max(0.0, slopes[len(slopes) // 2]) if slopes else 0.0

    def verify_cost(self, width: int) -> float:
        """A pass over `width` tokens in one-token passes, from the measured curve (beyond its widest point, a
        straight line at the median slope)."""
        widest = max(self.pass_s)
        if width <= widest:
            return self.pass_s[width] / self.step_s
        return self.pass_s[widest] / self.step_s + self.verify_slope * (width - widest)


@dataclass(frozen=True)
class Batching:
    """Fused passes over several sequences of one pool, as a runtime can run them exactly."""

    width: int  # the most tokens one fused pass may hold with every token's logits those of a one-token pass
    prefills_in_slots_exactly: bool  # a prompt prefilled beside other sequences equals one prefilled alone
    pass_cost: Callable[[list[tuple[Runner, int]]], float]  # a fused pass's cost in one-token passes, by its shape


class Runtime:
    """What specdec asks of a runtime. One instance per runtime: runtimes.TORCH, runtimes.LLAMA_CPP."""

    name: str
    early_exit = False  # a drafter may run the target's first N layers (self:N)
    default_draft_quantization: str | None = None  # what --quantize-draft auto means on it
    peers: dict[str, str] = {}  # the benchmark's peer methods that run on it (other implementations) -> what each is
    # The peer that decodes plainly from the same weights, which every benchmark and `generate --compare` measure as
    # the plain decoder to beat (None: target-only decoding is that baseline)
    baseline_peer: str | None = None
    # Whether the sequences of its pools prefill their prompts through a prompt cache (specdec_exact.prompt_cache),
    # reusing blocks exactly; where not, every prompt is prefilled whole
    caches_prompts = False

    def installed(self) -> bool:
        return True

    def owns(self, model) -> bool:
        """Whether a loaded model is one of this runtime's."""
        raise NotImplementedError

    def reads(self, spec) -> bool:
        """Whether it runs spec (a registry name, a path, a loaded model) as it is, with no conversion."""
        raise NotImplementedError

    def load(self, spec, tokenizer=None, *, dtype: torch.dtype = torch.float32, quantization: str | None = None,
             threads: int | None = None):
        """A model given as a registry name, a path or a loaded model -> (model, tokenizer)."""
        raise NotImplementedError

    def pull(self, name: str, progress: bool = True) -> Path:
        """What `specdec-exact models pull NAME --runtime R` prepares for a registry model -> its path."""
        raise NotImplementedError

    def vocab_size(self, model) -> int:
        """Rows of the model's output layer."""
        raise NotImplementedError

    def context_length(self, model) -> int:
        """Tokens one sequence of the model may hold (its trained context)."""
        raise NotImplementedError

    def kv_bytes_per_token(self, model) -> int:
        """Bytes of KV cache one cached token of one sequence takes."""
        raise NotImplementedError

    def eos_ids(self, model) -> frozenset[int]:
        """The token ids that end a generation, as the model file says (a tokenizer may add its own)."""
        return frozenset()

    def check_rollback(self, model) -> None:
        """Refuse a model whose cache cannot be cut back to any length (speculation needs it)."""

    def prepare(self, model) -> None:
        """Measure now what any of the model's passes need (a draft model's too), not inside the first request."""

    def prepare_as_target(self, model) -> None:
        """Measure now what a target needs (its exact widths), not inside the first request's timing."""

    def pool(self, model, sequences: int = 1, max_length: int | None = None,
             prompt_cache: PromptCache | None = None) -> SequencePool:
        """The model's sequences for a batch of `sequences` requests of up to max_length tokens each, whose prompts
        are prefilled through prompt_cache where the runtime caches prompts."""
        raise NotImplementedError

    def own_pool(self, model, max_length: int | None = None,
                 prompt_cache: PromptCache | None = None) -> SequencePool:
        """A pool of one sequence that no other request shares, freed with its sequence: where a request of a larger
        batch runs as a batch of one would (what pool(model, 1) gives may be shared by whoever decodes alone)."""
        return self.pool(model, 1, max_length, prompt_cache)

    def costs(self, model) -> PassCosts | None:
        """The measured costs of the model's passes, where the runtime measures them."""
        return None

    def step_estimate(self, model) -> float | None:
        """Seconds of one of the model's one-token passes, timed in a few passes before anything of it is calibrated
        (None where the runtime does not time its models): whether a draft model could pay at all on this machine is
        known before its calibration is paid for."""
        return None

    def known_step_estimate(self, spec, target, threads: int | None = None) -> float | None:
        """What step_estimate found, at an earlier load on this machine with this many threads, for the draft model
        `spec` names (a path or registry name) beside `target`, without loading it; None where nothing was found, the
        runtime keeps none, or the draft is not judged by its step (another vocabulary than the target's)."""
        return None

    def batching(self, model) -> Batching | None:
        """How the model's sequences can share passes exactly; None where each sequence takes passes of its own."""
        return None

    def kernel_plan(self, model) -> str | None:
        """Which kernels the model's passes run, in words, where the runtime chooses them."""
        return None

    def describe(self, model) -> dict:
        """What a benchmark records about a loaded model."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<runtime {self.name}>"
