"""The decoding loop: prefill, then draft -> verify in one target pass -> commit the accepted prefix -> roll back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.metrics import SpecStats
from specdec.runners import Runner
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.verify import greedy_verify, rejection_sample


class KPolicy(Protocol):
    def next_k(self) -> int: ...
    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None: ...


@dataclass(frozen=True)
class Step:
    tokens: list[int]  # tokens committed by one cycle, in order
    n_from_draft: int  # the first n_from_draft of them were authored by the drafter (accepted draft tokens)
    finish_reason: str | None = None  # "stop" (end-of-sequence token), "length" (token budget or context), or None


def speculative_decode(target: Runner, drafter: Drafter, prompt_ids: torch.Tensor, *, k: KPolicy,
                       max_new_tokens: int, sampling: SamplingConfig, generator: torch.Generator,
                       eos_ids: frozenset[int] = frozenset(), stats: SpecStats | None = None) -> Iterator[Step]:
    """Yield the tokens of prompt_ids [1, n] continued by the target, as each cycle commits them.

    k chooses the number of draft tokens each cycle (specdec.adaptive: FixedK, AdaptiveK).

    The prefill evaluates the whole prompt and gives p for the first new token, as plain decoding does (llama.cpp's
    and transformers' loops), so target-only output matches theirs token for token. After that the target's cache
    holds every committed token but the newest one; each cycle feeds that token plus the draft, so one target pass
    yields p at the k draft positions and at the bonus position. A runner whose logits depend on the width of a pass
    (or on the context length) says how wide a pass may be (verify_width), and no cycle drafts beyond it.
    """
    decoding = Decoding(target, drafter, prompt_ids, k=k, max_new_tokens=max_new_tokens, sampling=sampling,
                        generator=generator, eos_ids=eos_ids, stats=stats)
    while not decoding.done:
        feed = decoding.propose()
        started = time.perf_counter()
        logits = target.forward(feed) if feed is not None else None
        yield decoding.commit(logits, time.perf_counter() - started)


class Decoding:
    """One request being decoded: what the loop keeps between cycles, so that the cycles of several requests can
    share target passes (batch_cycle). A cycle is propose() -> one target pass over what it returns -> commit()."""

    def __init__(self, target: Runner, drafter: Drafter, prompt_ids: torch.Tensor, *, k: KPolicy,
                 max_new_tokens: int, sampling: SamplingConfig, generator: torch.Generator,
                 eos_ids: frozenset[int] = frozenset(), stats: SpecStats | None = None, pinned_k: bool = False):
        """Prefills the prompt [1, n] at once (its last row gives p for the first new token). pinned_k: in a batch,
        draft as this decoding would alone (see batch_cycle)."""
        self.pinned_k = pinned_k
        self.target, self.drafter, self.k = target, drafter, k
        self.max_new_tokens, self.sampling, self.generator, self.eos_ids = max_new_tokens, sampling, generator, eos_ids
        self.stats = stats if stats is not None else SpecStats()
        self.started = time.perf_counter()
        drafter.begin(prompt_ids)
        self.context = prompt_ids  # [1, n] every committed token
        self.pending = target.forward(prompt_ids, last_only=True)  # [1, 1, vocab]: p for the first new token
        self.stats.target_calls += 1
        self.stats.prefill_s = time.perf_counter() - self.started
        self.emitted = 0
        self.done = max_new_tokens <= 0
        self._proposal: Proposal | None = None
        self._budget = 0  # tokens this cycle may still emit (token budget and room in the context)
        self._drafted_s = 0.0

    def propose(self, max_width: int | None = None) -> torch.Tensor | None:
        """Draft this cycle -> the tokens the target must evaluate for it ([1, n]: the newest committed token, then
        the draft), or None when the cycle needs no target pass (no room left, or the prefill's logits suffice).
        max_width caps the pass further (a batch shares its width among its sequences)."""
        tick = time.perf_counter()
        room = self.target.max_length - self.context.shape[1]  # positions left in the target's context
        if room <= 0:
            self._proposal = None
            return None
        budget = self._budget = min(self.max_new_tokens - self.emitted, room)
        widest = verify_width(self.target, self.context.shape[1], self.max_new_tokens + 1)
        if widest == 1:
            self.stats.narrowed_cycles += 1
        widest = min(widest, max_width or widest)
        # Drafting beyond budget - 1 tokens is wasted: the cycle emits n_accepted + 1 tokens.
        n = min(self.k.next_k(), budget - 1, widest - 1)
        self._proposal = self.drafter.propose(self.context, max(n, 0), self.sampling, self.generator)
        self._drafted_s = time.perf_counter() - tick
        draft = self._proposal.tokens  # [1, n_draft]
        if self.pending is None:
            return torch.cat([self.context[:, -1:], draft], dim=1)
        return draft if draft.shape[1] else None

    def commit(self, logits: torch.Tensor | None, verify_s: float = 0.0) -> Step:
        """Verify the proposal against the target's logits for the tokens propose() returned (None if it returned
        None), commit the accepted prefix and the correction or bonus token, roll the caches back -> the Step."""
        stats, proposal = self.stats, self._proposal
        if proposal is None:  # the context is full
            self.done = True
            stats.total_s = time.perf_counter() - self.started
            return Step([], 0, "length")
        draft = proposal.tokens
        if self.pending is not None:  # the first cycle: the prefill gave p at the newest token
            logits = self.pending if logits is None else torch.cat([self.pending, logits], dim=1)
            calls = int(draft.shape[1] > 0)
            self.pending = None
        else:
            calls = 1
        if self.sampling.greedy:
            tokens, n_accepted = greedy_verify(draft, logits)
        else:
            tokens, n_accepted = rejection_sample(draft, proposal.probs, logits_to_probs(logits, self.sampling),
                                                  self.generator)
        n_accepted = int(n_accepted[0])
        self.target.rollback(self.context.shape[1] + n_accepted)
        self.drafter.accept(draft.shape[1], n_accepted)
        self.k.observe(draft.shape[1], n_accepted, self._drafted_s, verify_s)
        stats.draft_s += self._drafted_s
        stats.verify_s += verify_s
        stats.target_calls += calls
        stats.draft_calls += proposal.forward_calls
        stats.observe(draft.shape[1], n_accepted, proposal.source or self.drafter.name)
        stats.drafter_counts.update(proposal.counts)

        step = _truncate(tokens[0, : n_accepted + 1].tolist(), n_accepted, self._budget, self.eos_ids)
        self.context = torch.cat([self.context, tokens[:, : len(step.tokens)]], dim=1)
        self.emitted += len(step.tokens)
        stats.new_tokens = self.emitted
        stats.total_s = time.perf_counter() - self.started
        self.done = step.finish_reason is not None or self.emitted >= self.max_new_tokens
        self._proposal = None
        return step


def batch_cycle(decodings: list[Decoding], width: int) -> list[Step]:
    """One cycle of each unfinished decoding, their target passes fused (continuous batching with speculation).

    width: the most tokens one fused pass may hold while every token still gets the logits of a one-token pass of its
    own sequence (the runtime's calibrated batch width). Each decoding drafts within its share of it, except one
    with pinned_k (a seeded sample: how many tokens it drafts decides how its random stream is used, so it drafts as
    it would alone); the target evaluates all of them in as few passes of at most `width` tokens as they fit in, and
    each verifies, commits and rolls back on its own: acceptance is ragged. -> each decoding's Step, in order.
    """
    share = max(1, width // max(1, len(decodings)))
    feeds = [decoding.propose(None if decoding.pinned_k else share) for decoding in decodings]
    started = time.perf_counter()
    logits = iter(fused_forward([(d.target, feed) for d, feed in zip(decodings, feeds) if feed is not None], width))
    elapsed = time.perf_counter() - started
    return [d.commit(next(logits) if feed is not None else None, elapsed) for d, feed in zip(decodings, feeds)]


def fused_forward(items: list[tuple[Runner, torch.Tensor]], width: int) -> list[torch.Tensor]:
    """Each runner's logits for its tokens [1, n], evaluated in passes of at most `width` tokens in all: one pass per
    group where the runners' model can evaluate several sequences at once (forward_many), else one per runner."""
    groups, size = [[]], 0
    for runner, tokens in items:
        if groups[-1] and size + tokens.shape[1] > width:
            groups.append([])
            size = 0
        groups[-1].append((runner, tokens))
        size += tokens.shape[1]
    outputs = []
    for group in groups:
        model = getattr(group[0][0], "model", None) if group else None
        forward_many = getattr(model, "forward_many", None)
        if forward_many is not None and len(group) > 1 and all(r.model is model for r, _ in group):
            outputs += forward_many(group)
        else:
            outputs += [r.forward(t) for r, t in group]
    return outputs


def verify_width(target: Runner, length: int, default: int) -> int:
    """The widest pass over the target that reproduces one-token passes bit for bit after `length` tokens."""
    width_at = getattr(target, "verify_width", None)  # optional in the Runner protocol
    return (width_at(length) if width_at is not None else None) or default


def _truncate(new: list[int], n_from_draft: int, budget: int, eos_ids: frozenset[int]) -> Step:
    """Cut a cycle's tokens at the first end-of-sequence token (dropped) or at the token budget."""
    for i, token in enumerate(new[:budget]):
        if token in eos_ids:
            return Step(new[:i], min(n_from_draft, i), "stop")
    if len(new) >= budget:
        return Step(new[:budget], min(n_from_draft, budget), "length")
    return Step(new, n_from_draft, None)
