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

    The target's cache always holds every committed token but the newest one; each cycle feeds that token plus the
    draft, so one target pass yields p at the k draft positions and at the bonus position. A runner whose logits
    depend on the width of a pass sets max_verify_width, and no cycle drafts beyond it.
    """
    stats = stats if stats is not None else SpecStats()
    started = time.perf_counter()
    drafter.begin(prompt_ids)
    context = prompt_ids  # [1, n] every committed token
    if context.shape[1] > 1:
        target.forward(context[:, :-1], last_only=True)
        stats.target_calls += 1
    stats.prefill_s = time.perf_counter() - started
    emitted = 0
    widest = getattr(target, "max_verify_width", None) or max_new_tokens + 1
    while emitted < max_new_tokens:
        room = target.max_length - context.shape[1]  # positions left in the target's context
        if room <= 0:
            yield Step([], 0, "length")
            break
        budget = min(max_new_tokens - emitted, room)
        tick = time.perf_counter()
        # Drafting beyond budget - 1 tokens is wasted: the cycle emits n_accepted + 1 tokens.
        proposal = drafter.propose(context, min(k.next_k(), budget - 1, widest - 1), sampling, generator)
        draft = proposal.tokens  # [1, n_draft]
        tock = time.perf_counter()
        logits = target.forward(torch.cat([context[:, -1:], draft], dim=1))  # [1, n_draft + 1, vocab]
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
        stats.target_calls += 1
        stats.draft_calls += proposal.forward_calls
        stats.observe(draft.shape[1], n_accepted)

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


def _truncate(new: list[int], n_from_draft: int, budget: int, eos_ids: frozenset[int]) -> Step:
    """Cut a cycle's tokens at the first end-of-sequence token (dropped) or at the token budget."""
    for i, token in enumerate(new[:budget]):
        if token in eos_ids:
            return Step(new[:i], min(n_from_draft, i), "stop")
    if len(new) >= budget:
        return Step(new[:budget], min(n_from_draft, budget), "length")
    return Step(new, n_from_draft, None)
