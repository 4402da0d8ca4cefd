"""The decoding algorithm: prefill, then draft -> verify in one target pass -> commit the accepted prefix -> roll back.

A Decoding is one sequence's state between cycles. A cycle is propose() (the drafter guesses k tokens) -> one target
pass over the tokens it returns -> commit() (verification accepts a prefix, the target's cache is rolled back to the
committed tokens). speculative_decode runs the cycles of one sequence; batching.batch_cycle runs one cycle of several
sequences with their target passes fused, which is what generate() (a batch of one) and the server run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator, Protocol

import torch

from specdec_exact import grammar
from specdec_exact.adjust import LogitAdjust
from specdec_exact.drafters.base import Drafter, Proposal
from specdec_exact.grammar import Constraint
from specdec_exact.logprobs import TokenLogprob, token_logprobs
from specdec_exact.metrics import SpecStats
from specdec_exact.runtimes.base import Runner, prefill
from specdec_exact.sampling import SamplingConfig, logits_to_probs
from specdec_exact.verify import greedy_verify, rejection_sample


class KPolicy(Protocol):
    acceptance: float | None  # the policy's estimate of each draft token's chance of acceptance, if it keeps one

    def next_k(self) -> int: ...
    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None: ...


@dataclass(frozen=True)
class Step:
    tokens: list[int]  # tokens committed by one cycle, in order
    n_from_draft: int  # the first n_from_draft of them were authored by the drafter (accepted draft tokens)
    finish_reason: str | None = None  # "stop" (end-of-sequence token), "length" (token budget or context), or None
    logprobs: tuple[TokenLogprob, ...] = ()  # per token, where the request asks for them (specdec_exact.logprobs)


def speculative_decode(target: Runner, drafter: Drafter, prompt_ids: torch.Tensor, *, k: KPolicy,
                       max_new_tokens: int, sampling: SamplingConfig, generator: torch.Generator,
                       eos_ids: frozenset[int] = frozenset(), stats: SpecStats | None = None,
                       constraint: Constraint | None = None, adjust: LogitAdjust | None = None) -> Iterator[Step]:
    """Yield the tokens of prompt_ids [1, n] continued by the target, as each cycle commits them.

    k chooses the number of draft tokens each cycle (specdec_exact.adaptive: FixedK, AdaptiveK).

    The prefill evaluates the whole prompt and gives p for the first new token, as plain decoding does (llama.cpp's
    and transformers' loops), so target-only output matches theirs token for token. After that the target's cache
    holds every committed token but the newest one; each cycle feeds that token plus the draft, so one target pass
    yields p at the k draft positions and at the bonus position. A runner whose logits depend on the width of a pass
    (or on the context length) says how wide a pass may be (verify_width), and no cycle drafts beyond it.
    """
    decoding = Decoding(target, drafter, prompt_ids, k=k, max_new_tokens=max_new_tokens, sampling=sampling,
                        generator=generator, eos_ids=eos_ids, stats=stats, constraint=constraint, adjust=adjust)
    while not decoding.done:
        feed = decoding.propose()  # [1, n]: the newest committed token and the draft
        started = time.perf_counter()
        logits = target.forward(feed) if feed is not None else None  # [1, n, vocab]
        yield decoding.commit(logits, time.perf_counter() - started)


class Decoding:
    """One sequence being decoded: what the loop keeps between cycles, so that the cycles of several sequences can
    share target passes (batching.batch_cycle). A cycle is propose() -> one target pass over what it returns ->
    commit()."""

    def __init__(self, target: Runner, drafter: Drafter, prompt_ids: torch.Tensor, *, k: KPolicy,
                 max_new_tokens: int, sampling: SamplingConfig, generator: torch.Generator,
                 eos_ids: frozenset[int] = frozenset(), stats: SpecStats | None = None, pinned_k: bool = False,
                 prefill_now: bool = True, logprobs: int | None = None, adjust: LogitAdjust | None = None,
                 constraint: Constraint | None = None):
        """Prefills the prompt [1, n] (its last row gives p for the first new token): at once, or with prefill_now
        False pass by pass through prefill_step() (a batch runs other sequences' cycles between the passes); with no
        token to generate, nothing is evaluated. pinned_k: in a batch, draft as this decoding would alone (see
        batching.batch_cycle). logprobs: each Step carries its tokens' log-probabilities with this many alternatives
        (None: none). adjust: the logit bias and penalties applied to every row before verification; constraint: the
        grammar whose mask every row gets before verification (specdec_exact.grammar)."""
        self.pinned_k, self.logprobs, self.adjust, self.constraint = pinned_k, logprobs, adjust, constraint
        self.n_prompt = prompt_ids.shape[1]
        self.target, self.drafter, self.k = target, drafter, k
        self.max_new_tokens, self.sampling, self.generator, self.eos_ids = max_new_tokens, sampling, generator, eos_ids
        self.stats = stats if stats is not None else SpecStats()
        self.started = time.perf_counter()
        self.context = prompt_ids  # [1, n] every committed token
        self.emitted = 0
        self.done = max_new_tokens <= 0
        self.pending = None  # [1, 1, vocab]: the prefill's p for the first new token, until the first cycle uses it
        self._prefill = None  # the prefill's passes while some are left (runtimes.base.prefill)
        if not self.done:
            drafter.begin(prompt_ids)
            self._prefill = prefill(target, prompt_ids)
            self.stats.target_calls += 1
        self._proposal: Proposal | None = None
        self._budget = 0  # tokens this cycle may still emit (token budget and room in the context)
        self._drafted_s = 0.0
        self._cached = target.length  # what the target's cache held before this cycle's pass
        self.n_drafted = 0  # draft tokens of this cycle's proposal that the drafter made (not padding)
        self.max_draft = 0  # the most draft tokens this cycle may verify (its token budget, the exact verify width)
        if prefill_now:
            while self.prefilling:
                self.prefill_step()

    @property
    def prefilling(self) -> bool:
        """Whether passes of the prompt's prefill are left (no cycle may run before they are done)."""
        return self._prefill is not None

    def prefill_step(self) -> None:
        """The prompt's next prefill pass (stats.prefill_s counts the time of these passes alone)."""
        tick = time.perf_counter()
        try:
            next(self._prefill)
        except StopIteration as end:
            self._prefill, self.pending = None, end.value
            self._cached = self.target.length
            self.stats.cached_prompt_tokens = self.target.prompt_tokens_reused
            self.stats.prompt_cache_s = self.target.prompt_cache_s
        except BaseException:
            self._prefill = None
            raise
        finally:
            self.stats.prefill_s += time.perf_counter() - tick

    def close(self) -> None:
        """Stop a prefill still under way: its sequence keeps nothing of the prompt (the runner stays open)."""
        if self._prefill is not None:
            self._prefill.close()
            self._prefill = None

    def propose(self, max_width: int | None = None) -> torch.Tensor | None:
        """Draft this cycle -> the tokens the target must evaluate for it ([1, n]: the newest committed token, then
        the draft), or None when the cycle needs no target pass (no room left, or the prefill's logits suffice).
        max_width caps the pass further (a batch shares its width among its sequences)."""
        if self.prefilling:
            raise RuntimeError("the prompt's prefill is not done: call prefill_step() until prefilling is False")
        tick = time.perf_counter()
        self._cached = self.target.length
        room = self.target.max_length - self.context.shape[1]  # positions left in the target's context
        if room <= 0:
            self._proposal = None
            return None
        budget = self._budget = min(self.max_new_tokens - self.emitted, room)
        widest = self.target.verify_width(self.context.shape[1]) or self.max_new_tokens + 1
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
        (else this sequence's share of accepted draft tokens so far, from a prior of one accepted and one rejected)."""
        estimate = self._proposal.acceptance if self._proposal is not None else None
        if estimate is None:
            estimate = self.k.acceptance  # AdaptiveK keeps one; FixedK does not (None)
        if estimate is None:
            estimate = (self.stats.accepted_tokens + 1) / (self.stats.drafted_tokens + 2)
        return estimate

    def reshape(self, n_draft: int) -> torch.Tensor | None:
        """Cut this cycle's draft to its first n_draft tokens, or pad it to n_draft with copies of its last token
        (proposed with q = 1, so verification stays exact: the target accepts such a token only with its own
        probability) -> the tokens the target must now evaluate. A batch does this to give every sequence of a fused
        pass the same number of tokens (batching.shape_pass). The drafter hears only of its own tokens."""
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
        None), commit the accepted prefix and the correction or bonus token -> the Step. The target's cache is rolled
        back in any case: to the committed tokens, or, if verification fails, to what it held before the pass."""
        stats, proposal = self.stats, self._proposal
        if proposal is None:  # the context is full
            self.done = True
            stats.total_s = time.perf_counter() - self.started
            return Step([], 0, "length")
        self._proposal = None
        draft = proposal.tokens  # [1, n_draft]
        keep = self._cached
        try:
            if self.pending is not None:  # the first cycle: the prefill gave p at the newest token
                logits = self.pending if logits is None else torch.cat([self.pending, logits], dim=1)
                calls = int(draft.shape[1] > 0)
                self.pending = None
            else:
                calls = 1
            raw = logits  # (what logprobs report: the model's own distribution)
            if self.adjust is not None:  # row j follows the tokens generated so far and the first j draft tokens
                logits = self.adjust.rows(logits[0], self.context[0, self.n_prompt:].tolist(), draft[0].tolist())[None]
            if self.constraint is not None:  # row j masked as after the first j draft tokens
                tick = time.perf_counter()
                logits = grammar.apply(logits[0], self.constraint.masks(draft[0].tolist(), logits.shape[1]))[None]
                stats.grammar_s += time.perf_counter() - tick
            if self.sampling.greedy:
                tokens, n_accepted = greedy_verify(draft, logits)  # [1, n_draft + 1], [1]
            else:
                tokens, n_accepted = rejection_sample(draft, proposal.probs, logits_to_probs(logits, self.sampling),
                                                      self.generator)
            n_accepted = int(n_accepted[0])
            keep = self.context.shape[1] + n_accepted  # committed tokens and accepted drafts; not the newest token
        finally:
            self.target.rollback(keep)
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
        if self.constraint is not None:
            self.constraint.commit(step.tokens)
        if self.logprobs is not None:  # (the rows of this cycle's committed tokens: row i gave token i)
            step = replace(step, logprobs=token_logprobs(raw[0], step.tokens, self.logprobs))
        self.context = torch.cat([self.context, tokens[:, : len(step.tokens)]], dim=1)
        self.emitted += len(step.tokens)
        stats.new_tokens = self.emitted
        stats.total_s = time.perf_counter() - self.started
        self.done = step.finish_reason is not None or self.emitted >= self.max_new_tokens
        return step


    def stop_at(self, step: Step, kept: int) -> None:
        """The output ended within the last step, after `kept` of its tokens (a stop string): generation is over, and
        the tokens after those do not count as generated."""
        self.emitted -= len(step.tokens) - kept
        self.stats.new_tokens = self.emitted
        self.done = True


def _truncate(new: list[int], n_from_draft: int, budget: int, eos_ids: frozenset[int]) -> Step:
    """Cut a cycle's tokens at the first end-of-sequence token (dropped) or at the token budget."""
    for i, token in enumerate(new[:budget]):
        if token in eos_ids:
            return Step(new[:i], min(n_from_draft, i), "stop")
    if len(new) >= budget:
        return Step(new[:budget], min(n_from_draft, budget), "length")
    return Step(new, n_from_draft, None)
