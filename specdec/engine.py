"""The decoding loop: prefill, then draft -> verify in one target pass -> commit the accepted prefix -> roll back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from specdec.adaptive import expected_tokens
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
        self.n_drafted = 0  # draft tokens of this cycle's proposal that the drafter made (not padding)
        self.max_draft = 0  # the most draft tokens this cycle may verify (its token budget, the exact verify width)

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
        # Drafting beyond budget - 1 tokens is wasted: the cycle emits n_accepted + 1 tokens.
        self.max_draft = max(0, min(budget - 1, widest - 1))
        n = min(self.k.next_k(), self.max_draft, (max_width or widest) - 1)
        self._proposal = self.drafter.propose(self.context, max(n, 0), self.sampling, self.generator)
        self._drafted_s = time.perf_counter() - tick
        self.n_drafted = self._proposal.tokens.shape[1]
        return self._feed()

    @property
    def proposing(self) -> bool:
        """Whether propose() made a proposal that commit() has yet to verify (not when the context is full)."""
        return self._proposal is not None

    def _feed(self) -> torch.Tensor | None:
        draft = self._proposal.tokens  # [1, n_draft]
        if self.pending is None:
            return torch.cat([self.context[:, -1:], draft], dim=1)
        return draft if draft.shape[1] else None

    def feed_width(self, n_draft: int) -> int:
        """Tokens the target evaluates for this cycle if it drafts n_draft (its first cycle feeds only the draft)."""
        return n_draft + (self.pending is None)

    @property
    def acceptance(self) -> float:
        """The chance that each token of this cycle's draft is accepted, as the drafter or the k policy estimates it
        (else this request's share of accepted draft tokens so far, from a prior of one accepted and one rejected)."""
        estimate = self._proposal.acceptance if self._proposal is not None else None
        if estimate is None:
            estimate = getattr(self.k, "acceptance", None)
        if estimate is None:
            estimate = (self.stats.accepted_tokens + 1) / (self.stats.drafted_tokens + 2)
        return estimate

    def reshape(self, n_draft: int) -> torch.Tensor | None:
        """Cut this cycle's draft to its first n_draft tokens, or pad it to n_draft with copies of its last token
        (proposed with q = 1, so verification stays exact: the target accepts such a token only with its own
        probability) -> the tokens the target must now evaluate. A batch does this to give every sequence of a fused
        pass the same number of tokens (batch_cycle). The drafter hears only of its own tokens."""
        proposal = self._proposal
        have = proposal.tokens.shape[1]
        if n_draft < have:
            proposal = proposal.prefix(n_draft)
        elif n_draft > have:
            last = proposal.tokens[:, -1:] if have else self.context[:, -1:]
            proposal = proposal.padded(last, n_draft - have)
        self._proposal, self.n_drafted = proposal, min(have, n_draft)
        return self._feed()

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
        # What the drafter proposed, without the padding of a batch (reshape)
        n_drafted, n_authored = self.n_drafted, min(n_accepted, self.n_drafted)
        self.drafter.accept(n_drafted, n_authored)
        self.k.observe(n_drafted, n_authored, self._drafted_s, verify_s)
        stats.draft_s += self._drafted_s
        stats.verify_s += verify_s
        stats.target_calls += calls
        stats.draft_calls += proposal.forward_calls
        stats.observe(n_drafted, n_authored, proposal.source or self.drafter.name)
        stats.drafter_counts.update(proposal.counts)

        step = _truncate(tokens[0, : n_accepted + 1].tolist(), n_authored, self._budget, self.eos_ids)
        self.context = torch.cat([self.context, tokens[:, : len(step.tokens)]], dim=1)
        self.emitted += len(step.tokens)
        stats.new_tokens = self.emitted
        stats.total_s = time.perf_counter() - self.started
        self.done = step.finish_reason is not None or self.emitted >= self.max_new_tokens
        self._proposal = None
        return step


def batch_cycle(decodings: list[Decoding], width: int,
                pass_cost: Callable[[list[tuple[Runner, int]]], float] | None = None) -> list[Step]:
    """One cycle of each unfinished decoding, their target passes fused (continuous batching with speculation).

    width: the most tokens one fused pass may hold while every token still gets the logits of a one-token pass of its
    own sequence (the runtime's calibrated batch width). Each decoding drafts within its share of it, except one
    with pinned_k (a seeded sample: how many tokens it drafts decides how its random stream is used, so it drafts as
    it would alone). pass_cost, where the runtime knows what a fused pass costs (in one-token passes, from each
    runner and the number of tokens it feeds the pass), lets shape_pass cut or pad the drafts to the shape with the
    most expected tokens per unit of cost. The target evaluates all of them in as few passes of at most `width`
    tokens as they fit in, and each decoding verifies, commits and rolls back on its own: acceptance is ragged.
    -> each decoding's Step, in order.
    """
    share = max(1, width // max(1, len(decodings)))
    feeds = [decoding.propose(None if decoding.pinned_k else share) for decoding in decodings]
    if pass_cost is not None:
        feeds = shape_pass(decodings, feeds, width, pass_cost)
    started = time.perf_counter()
    logits = iter(fused_forward([(d.target, feed) for d, feed in zip(decodings, feeds) if feed is not None], width))
    elapsed = time.perf_counter() - started
    return [d.commit(next(logits) if feed is not None else None, elapsed) for d, feed in zip(decodings, feeds)]


def shape_pass(decodings: list[Decoding], feeds: list[torch.Tensor | None], width: int,
               pass_cost: Callable[[list[tuple[Runner, int]]], float]) -> list[torch.Tensor | None]:
    """Cut or pad this cycle's drafts so that the fused pass yields the most expected tokens per unit of its cost.

    A fused pass costs by its shape, not only by its token count: llama.cpp runs a pass whose sequences feed it
    different numbers of tokens as one sub-pass per step in those numbers, each streaming the weights once. So every
    draft may be cut to at most `cap` tokens, and the short ones then either left short (a ragged pass) or padded up
    to `cap` with filler tokens proposed with q = 1, which the target accepts only with its own probability (one
    sub-pass). The candidate with the most expected tokens (a draft of n tokens accepted with probability a each
    yields (1 - a^(n+1)) / (1 - a)) per unit of pass_cost wins; cap 0 is plain decoding. A decoding with pinned_k
    keeps its draft. -> the feeds to evaluate.
    """
    live = [i for i, decoding in enumerate(decodings) if decoding.proposing]
    flexible = [i for i in live if not decodings[i].pinned_k]
    if not flexible or len(live) < 2:  # alone, a decoding's drafter has already weighed its draft
        return feeds
    drafted = {i: decodings[i].n_drafted for i in live}
    acceptance = {i: decodings[i].acceptance for i in live}
    best, best_rate = drafted, 0.0
    for cap in range(max(drafted[i] for i in flexible) + 1):
        for pad in (False, True):
            plan = dict(drafted)
            for i in flexible:
                plan[i] = min(max(drafted[i], cap) if pad else drafted[i], cap, decodings[i].max_draft)
            expected = sum(expected_tokens(acceptance[i], min(plan[i], drafted[i])) for i in live)
            fed = [(decodings[i].target, decodings[i].feed_width(plan[i])) for i in live]
            groups = _groups([n for _, n in fed], [_pass_limit(runner, width) for runner, _ in fed])
            cost = sum(pass_cost([fed[j] for j in group]) for group in groups)
            if cost > 0 and expected / cost > best_rate + 1e-9:  # (a cycle with no pass at all stays as it was)
                best, best_rate = plan, expected / cost
    feeds = list(feeds)
    for i in flexible:
        if best[i] != drafted[i]:
            feeds[i] = decodings[i].reshape(best[i])
    return feeds


def fused_forward(items: list[tuple[Runner, torch.Tensor]], width: int) -> list[torch.Tensor]:
    """Each runner's logits for its tokens [1, n], evaluated in passes of at most `width` tokens in all: one pass per
    group where the runners' model can evaluate several sequences at once (forward_many), else one per runner. A
    sequence shares a pass only as wide as its own exact width where it stands (verify_width: beyond the context
    lengths the runtime checked, one token), so every token gets the logits of a one-token pass of its sequence."""
    outputs = []
    for indices in _groups([tokens.shape[1] for _, tokens in items], [_pass_limit(r, width) for r, _ in items]):
        group = [items[i] for i in indices]
        model = getattr(group[0][0], "model", None)
        forward_many = getattr(model, "forward_many", None)
        if forward_many is not None and len(group) > 1 and all(r.model is model for r, _ in group):
            outputs += forward_many(group)
        else:
            outputs += [r.forward(t) for r, t in group]
    return outputs


def _pass_limit(runner: Runner, width: int) -> int:
    """The most tokens a fused pass that holds this runner's next tokens may hold."""
    return min(width, verify_width(runner, runner.length, width))


def _groups(widths: list[int], limits: list[int]) -> list[list[int]]:
    """Consecutive items of these token counts, grouped into passes that hold at most the smallest limit of their
    items (an item wider than its limit gets a pass of its own) -> the items' indices, pass by pass."""
    groups, size, cap = [], 0, 0
    for i, (n, limit) in enumerate(zip(widths, limits)):
        if not n:
            continue
        if not groups or size + n > min(cap, limit):
            groups.append([])
            size, cap = 0, limit
        groups[-1].append(i)
        size, cap = size + n, min(cap, limit)
    return groups


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
