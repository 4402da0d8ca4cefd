"""The drafter protocol: every way of guessing ahead implements these three calls."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

from specdec_exact.sampling import SamplingConfig

if TYPE_CHECKING:
    from specdec_exact.runtimes.base import SequencePool


@dataclass
class Proposal:
    tokens: torch.Tensor  # [batch, n] draft tokens, n <= k (n = 0: the cycle is one plain target step)
    probs: torch.Tensor | None = None  # q [batch, n, vocab]; None for deterministic drafters (one-hot q)
    forward_calls: int = 0  # model forward passes spent on this proposal
    source: str | None = None  # which drafter authored it, where one drafter delegates to others (None: the drafter)
    counts: dict[str, float] = field(default_factory=dict)  # what is specific to the drafter, summed in SpecStats
    acceptance: float | None = None  # the drafter's estimate of each token's chance of acceptance, if it keeps one

    @staticmethod
    def empty(batch: int = 1) -> "Proposal":
        return Proposal(torch.zeros(batch, 0, dtype=torch.long))

    def prefix(self, n: int) -> "Proposal":
        """The first n tokens of this proposal (and their q)."""
        if self.tokens.shape[1] == n:
            return self
        probs = self.probs[:, :n] if self.probs is not None else None
        return replace(self, tokens=self.tokens[:, :n], probs=probs)

    def padded(self, token: torch.Tensor, n: int) -> "Proposal":
        """This proposal followed by n copies of token [batch, 1], each proposed with q = 1 on it."""
        filler = token.expand(-1, n)
        probs = self.probs
        if probs is not None:
            one_hot = torch.zeros(probs.shape[0], n, probs.shape[2], dtype=probs.dtype)
            probs = torch.cat([probs, one_hot.scatter_(2, filler.unsqueeze(-1), 1.0)], dim=1)
        return replace(self, tokens=torch.cat([self.tokens, filler], dim=1), probs=probs)


Pools = Callable[[object], "SequencePool"]  # a loaded model -> the pool its sequences come from (runtimes.base)


class Drafter:
    """Base drafter; subclasses override `propose` and, if they keep state, `begin` and `accept`."""

    name = "drafter"
    chooses_k = False  # True: the drafter decides how many tokens to draft, and the engine's k only caps it
    model = None  # the draft model it runs, if any
    last_match = 0  # tokens of the context the last proposal was matched on (lookup drafters; 0: not a lookup)
    # The share of the matched occurrences that went on with the last proposal's first token (lookup drafters)
    last_agreement = 1.0
    # Set by a batch before each cycle: other requests wait on this one's passes, so a drafter spreads long work (a
    # draft model reading a prompt) over cycles; alone, it does it at once.
    others_waiting = False
    # Set by a batch for a seeded sample, which must repeat exactly: a drafter that weighs drafts by what passes cost
    # uses the calibrated costs alone, never what the clock says (ServedPassCosts)
    by_calibration_alone = False

    def begin(self, prompt_ids: torch.Tensor) -> None:
        """A new generation starts from prompt_ids [batch, n]."""

    def propose(self, context: torch.Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Proposal:
        """Guess up to k tokens that follow context [batch, n] (every committed token so far)."""
        raise NotImplementedError

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        """The target accepted the first n_accepted of the n_drafted tokens of the last proposal."""

    def observe_pass(self, width: int, seconds: float) -> None:
        """The target pass that verified the last proposal held `width` tokens, of this sequence alone, and took
        `seconds` (a drafter that weighs drafts against what passes cost may learn from it)."""

    def fork(self, pools: Pools | None = None, shared_history: bool = True) -> Drafter:
        """A drafter like this one for one request: the same settings and shared models, per-request state of its
        own. Every request drafts with a fork (generate() too), whose draft-model sequence comes from pools(model)
        (the pool of the batch the request runs in). shared_history: the fork reads and extends the history of
        earlier requests that this drafter keeps, where it keeps one (suffix lookup); False for a seeded sample,
        whose draft must depend on nothing but itself. The default, a shallow copy, suits drafters whose
        per-request state is set anew by begin()."""
        return copy.copy(self)

    def close(self) -> None:
        """The request ended: free what its state holds (a draft model's sequence slot)."""


class NoDrafter(Drafter):
    """Proposes nothing: every cycle is one plain target step. This is the target-only baseline."""

    name = "none"

    def propose(self, context, k, sampling, generator) -> Proposal:
        return Proposal.empty(context.shape[0])
