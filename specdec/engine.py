"""The decoding loop: prefill, then draft -> verify in one target pass -> commit the accepted prefix -> roll back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from specdec.drafters.base import Drafter
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
    stats = stats if stats is not None else SpecStats()
    started = time.perf_counter()
    drafter.begin(prompt_ids)
    context = prompt_ids  # [1, n] every committed token
    pending = target.forward(context, last_only=True)  # [1, 1, vocab]: p for the first new token
    stats.target_calls += 1
    stats.prefill_s = time.perf_counter() - started
    emitted = 0
    while emitted < max_new_tokens:
        room = target.max_length - context.shape[1]  # positions left in the target's context
        if room <= 0:
            yield Step([], 0, "length")
            break
        budget = min(max_new_tokens - emitted, room)
        tick = time.perf_counter()
        widest = verify_width(target, context.shape[1], max_new_tokens + 1)
        if widest == 1:
            stats.narrowed_cycles += 1
        # Drafting beyond budget - 1 tokens is wasted: the cycle emits n_accepted + 1 tokens.
        proposal = drafter.propose(context, min(k.next_k(), budget - 1, widest - 1), sampling, generator)
        draft = proposal.tokens  # [1, n_draft]
        tock = time.perf_counter()
        logits, calls = _verify_pass(target, context, draft, pending)  # [1, n_draft + 1, vocab]
        pending = None
        if sampling.greedy:
            tokens, n_accepted = greedy_verify(draft, logits)
        else:
            tokens, n_accepted = rejection_sample(draft, proposal.probs, logits_to_probs(logits, sampling), generator)
        n_accepted = int(n_accepted[0])
        target.rollback(context.shape[1] + n_accepted)
        drafter.accept(draft.shape[1], n_accepted)
        verified = time.perf_counter()
        k.observe(draft.shape[1], n_accepted, tock - tick, verified - tock)
        stats.draft_s += tock - tick
        stats.verify_s += verified - tock
        stats.target_calls += calls
        stats.draft_calls += proposal.forward_calls
        stats.observe(draft.shape[1], n_accepted, proposal.source or drafter.name)

        new = tokens[0, : n_accepted + 1].tolist()
        step = _truncate(new, n_accepted, budget, eos_ids)
        context = torch.cat([context, tokens[:, : len(step.tokens)]], dim=1)
        emitted += len(step.tokens)
        stats.new_tokens = emitted
        stats.total_s = time.perf_counter() - started
        yield step
        if step.finish_reason:
            break
    stats.total_s = time.perf_counter() - started


def verify_width(target: Runner, length: int, default: int) -> int:
    """The widest pass over the target that reproduces one-token passes bit for bit after `length` tokens."""
    width_at = getattr(target, "verify_width", None)  # optional in the Runner protocol
    return (width_at(length) if width_at is not None else None) or default


def _verify_pass(target: Runner, context: torch.Tensor, draft: torch.Tensor,
                 pending: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Target logits at the newest token and after each draft token -> ([1, n_draft + 1, vocab], target calls).

    pending: the newest token's logits when the prefill already computed them (the first cycle); only the draft is
    then fed, and a cycle that drafted nothing needs no pass at all.
    """
    if pending is None:
        return target.forward(torch.cat([context[:, -1:], draft], dim=1)), 1
    if draft.shape[1] == 0:
        return pending, 0
    return torch.cat([pending, target.forward(draft)], dim=1), 1


def _truncate(new: list[int], n_from_draft: int, budget: int, eos_ids: frozenset[int]) -> Step:
    """Cut a cycle's tokens at the first end-of-sequence token (dropped) or at the token budget."""
    for i, token in enumerate(new[:budget]):
        if token in eos_ids:
            return Step(new[:i], min(n_from_draft, i), "stop")
    if len(new) >= budget:
        return Step(new[:budget], min(n_from_draft, budget), "length")
    return Step(new, n_from_draft, None)
