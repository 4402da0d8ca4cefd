"""Decoding several requests at once: each cycle one Decoding step of every request, their target passes fused.

A Batch holds the requests being decoded (continuous batching: requests join between cycles while it has room and
leave when they finish), each in a sequence of the target's pool and with a drafter of its own. batch_cycle runs one
cycle of them: each drafts, shape_pass cuts or pads the drafts to the pass shape with the most expected tokens per
unit of cost, fused_forward evaluates them in as few passes as stay exact, and each commits on its own (acceptance is
ragged). generate() is a batch of one; the server's scheduler runs one batch.

A request's failure ends that request alone: batch_cycle returns its exception in place of its step, and a fused
pass that fails is evaluated again one sequence at a time, so that only the failing sequence fails.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Callable

import torch

from specdec_exact.adaptive import K_MAX, expected_tokens, make_k_policy
from specdec_exact.engine import Decoding, Step
from specdec_exact.grammar import Constraint
from specdec_exact.metrics import SpecStats
from specdec_exact.output import Chunk, Output
from specdec_exact.requests import Request
from specdec_exact.runtimes import runtime_of
from specdec_exact.runtimes.base import Runner, SequencePool
from specdec_exact.sampling import make_generator

log = logging.getLogger("specdec.batching")

PassCost = Callable[[list[tuple[Runner, int]]], float]


def batch_cycle(decodings: list[Decoding], width: int, pass_cost: PassCost | None = None
                ) -> list[Step | Exception]:
    """One cycle of each unfinished decoding, their target passes fused (continuous batching with speculation).

    width: the most tokens one fused pass may hold while every token still gets the logits of a one-token pass of its
    own sequence (the runtime's calibrated batch width). Each decoding drafts within its share of it, except one
    with pinned_k (a seeded sample: how many tokens it drafts decides how its random stream is used, so it drafts as
    it would alone). pass_cost, where the runtime knows what a fused pass costs (in one-token passes, from each
    runner and the number of tokens it feeds the pass), lets shape_pass cut or pad the drafts to the shape with the
    most expected tokens per unit of cost. -> each decoding's Step, or the exception that ended it, in order.
    """
    share = max(1, width // max(1, len(decodings)))
    outcomes: list[Step | Exception | None] = [None] * len(decodings)
    feeds: list[torch.Tensor | None] = [None] * len(decodings)
    for i, decoding in enumerate(decodings):
        try:
            feeds[i] = decoding.propose(None if decoding.pinned_k else share)
        except Exception as error:  # this request's drafter failed: it alone ends
            outcomes[i] = error
    live = [i for i in range(len(decodings)) if outcomes[i] is None]
    if pass_cost is not None:
        shaped = shape_pass([decodings[i] for i in live], [feeds[i] for i in live], width, pass_cost)
        for i, feed in zip(live, shaped):
            feeds[i] = feed
    passing = [i for i in live if feeds[i] is not None]
    started = time.perf_counter()
    logits = fused_forward([(decodings[i].target, feeds[i]) for i in passing], width)
    elapsed = time.perf_counter() - started
    results = dict(zip(passing, logits))
    if len(passing) == 1 and not isinstance(logits[0], Exception):  # what a pass of this width costs, where served
        decodings[passing[0]].drafter.observe_pass(feeds[passing[0]].shape[1], elapsed)
    for i in live:
        result = results.get(i)
        if isinstance(result, Exception):  # its pass failed (the runtime cut its cache back)
            outcomes[i] = result
            continue
        try:
            outcomes[i] = decodings[i].commit(result, elapsed)
        except Exception as error:
            outcomes[i] = error
    return outcomes


def shape_pass(decodings: list[Decoding], feeds: list[torch.Tensor | None], width: int,
               pass_cost: PassCost) -> list[torch.Tensor | None]:
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


def fused_forward(items: list[tuple[Runner, torch.Tensor]], width: int) -> list[torch.Tensor | Exception]:
    """Each runner's logits for its tokens [1, n], evaluated in passes of at most `width` tokens in all, one pass per
    group of runners of one pool (SequencePool.forward_many). A sequence shares a pass only as wide as its own exact
    width where it stands (verify_width: beyond the context lengths the runtime checked, one token), so every token
    gets the logits of a one-token pass of its sequence. A group whose pass fails is evaluated again one runner at a
    time: -> each runner's logits, or the exception its own pass raised."""
    outputs: list[torch.Tensor | Exception] = []
    for indices in _groups([tokens.shape[1] for _, tokens in items], [_pass_limit(r, width) for r, _ in items]):
        group = [items[i] for i in indices]
        pool = group[0][0].pool
        if pool is not None and len(group) > 1 and all(r.pool is pool for r, _ in group):
            lengths = [runner.length for runner, _ in group]
            try:
                outputs += pool.forward_many(group)
                continue
            except Exception:  # cut every sequence back to before the pass (some may have run), then one by one
                for (runner, _), length in zip(group, lengths):
                    runner.rollback(length)
        for runner, tokens in group:  # alone: the failing sequence fails by itself
            try:
                outputs.append(runner.forward(tokens))
            except Exception as error:
                outputs.append(error)
    return outputs


def _pass_limit(runner: Runner, width: int) -> int:
    """The most tokens a fused pass that holds this runner's next tokens may hold."""
    return min(width, runner.verify_width(runner.length) or width)


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


class Generation:
    """A request being decoded: its Decoding (a sequence of the target's pool, a drafter of its own), its output so
    far and its stats. `last` is set once it has finished (its last chunk)."""

    def __init__(self, request: Request, decoding: Decoding, output: Output):
        self.request, self.decoding, self.output = request, decoding, output
        self.last: Chunk | None = None

    @property
    def stats(self) -> SpecStats:
        return self.decoding.stats

    def close(self) -> None:
        """The request is over: a prefill under way stops, its sequences (target, draft model) go back to their
        pools."""
        self.decoding.close()
        self.decoding.target.close()
        self.decoding.drafter.close()


class Batch:
    """Requests decoded together: each step is one cycle of every unfinished request, their target passes fused
    (batch_cycle). Requests join with add() while room() > 0, and leave when they finish, fail or are dropped.

    max_batch: the most requests decoded at once; max_length: the most tokens one request's sequence holds, prompt
    and new tokens (default: the target's trained context). On a runtime that fuses passes only exactly
    (Batching.prefills_in_slots_exactly false on this CPU) a batch of several serves one request at a time instead.
    """

    def __init__(self, generator, max_batch: int = 1, max_length: int | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.generator = generator
        runtime, target = generator.runtime, generator.target
        batching = runtime.batching(target) if max_batch > 1 else None
        if batching is not None and not batching.prefills_in_slots_exactly:
            warnings.warn("on this CPU a prompt prefilled in a batch slot differs from one prefilled alone "
                          "(measure_batch_width): requests are served one at a time", RuntimeWarning, stacklevel=2)
            max_batch, batching = 1, None
        self.max_batch = max_batch
        self.width = batching.width if batching is not None else None  # None: each sequence passes alone
        self.pass_cost = batching.pass_cost if batching is not None else None
        self._max_length = max_length
        self.pools: dict[int, SequencePool] = {}  # id(model) -> its pool (made now for the target and draft model)
        for model in (target, generator.draft):
            if model is not None:
                self.pool(model)
        self.max_length = self.pool(target).max_length  # tokens one request may hold
        self.active: list[Generation] = []
        self._finished: list[Generation] = []  # finished in the last step, their answers not yet kept (keep_answers)

    def pool(self, model) -> SequencePool:
        """This batch's pool of a model's sequences (how a request's drafter gets its draft model's sequence)."""
        if id(model) not in self.pools:
            self.pools[id(model)] = runtime_of(model).pool(model, self.max_batch, self._max_length,
                                                           self.generator.prompt_cache)
        return self.pools[id(model)]

    def _pool_of_one(self, model) -> SequencePool:
        """A pool of one sequence of a model, as a batch of one has: where a seeded sample's draft model runs, so that
        its draft probabilities, which decide how its random stream is used, are those it has alone (passes in a slot
        beside other sequences are calibrated exact for the target only). Freed with the sequence taken from it."""
        if self.max_batch == 1:
            return self.pool(model)
        return runtime_of(model).own_pool(model, self._max_length, self.generator.prompt_cache)

    def room(self) -> int:
        """Requests that add() can start now (a finished request holds its slot until keep_answers() ran)."""
        return min(self.max_batch - len(self.active) - len(self._finished),
                   self.pools[id(self.generator.target)].free)

    def has_room(self) -> bool:
        return self.room() > 0

    def add(self, request: Request) -> Generation:
        """Start a request: a sequence of the target's pool and a drafter of its own -> its Generation (its `last`
        chunk already set when there is nothing to generate). Its prompt is prefilled by the next steps, a pass
        each. A request that does not fit raises ContextLengthExceeded (a ValueError)."""
        gen = self.generator
        request.check_fits(self.max_length)
        # A seeded sample depends on how much is drafted each cycle, so it must not read what other requests left in
        # the drafter's shared history. A tenant's requests draw on that tenant's earlier ones alone (Request.tenant).
        tenant = request.tenant
        pool = self.pool if not request.seeded_sample else self._pool_of_one
        drafter = gen.drafter_for(tenant).fork(lambda model: _TenantsPool(pool(model), tenant),
                                               shared_history=not request.seeded_sample)
        drafter.by_calibration_alone = request.seeded_sample
        runner = None
        try:
            runner = self.pool(gen.target).take(gen.vocab_size, tenant)
            k = _k_policy(request, drafter, gen.k_priors())
            stats = SpecStats()
            constraint = Constraint(request.grammar, gen.grammar_tokenizer()) if request.grammar else None
            decoding = Decoding(runner, drafter, torch.tensor([request.prompt_ids]), k=k,
                                max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                                generator=make_generator(request.seed), eos_ids=gen.eos_ids, stats=stats,
                                pinned_k=request.seeded_sample, prefill_now=False, logprobs=request.logprobs,
                                adjust=request.adjust, constraint=constraint)
        except BaseException:
            if runner is not None:
                runner.close()
            drafter.close()
            raise
        sequence = Generation(request, decoding, Output(gen.tokenizer, request.stop, stats,
                                                        logprobs=request.logprobs is not None))
        if decoding.done:
            sequence.close()
            sequence.last = sequence.output.collect(sequence.output.end())
        else:
            self.active.append(sequence)
        return sequence

    @property
    def prefilling(self) -> int:
        """Requests whose prompt is still being prefilled."""
        return sum(sequence.decoding.prefilling for sequence in self.active)

    def step(self) -> list[tuple[Generation, Chunk | Exception]]:
        """One cycle: a prefill pass of the earliest request still reading its prompt (chunked prefill: the others
        wait at most one pass for it), then a cycle of every request past its prefill -> each of those one's chunk,
        or the exception that ended it (a failed prefill's too; finished and failed requests leave the batch)."""
        self.keep_answers()
        results: list[tuple[Generation, Chunk | Exception]] = []
        reading = next((sequence for sequence in self.active if sequence.decoding.prefilling), None)
        if reading is not None:
            try:
                reading.decoding.prefill_step()
            except Exception as error:  # this request's prefill failed: it alone ends
                results.append((reading, error))
        failed = {sequence for sequence, _ in results}
        ready = [s for s in self.active if not s.decoding.prefilling and s not in failed]
        if ready:
            for sequence in ready:  # (a drafter spreads long work over cycles only where others wait on its passes)
                sequence.decoding.drafter.others_waiting = len(self.active) > 1
            width = self.width or (K_MAX + 1) * len(ready)
            outcomes = batch_cycle([sequence.decoding for sequence in ready], width, self.pass_cost)
            for sequence, outcome in zip(ready, outcomes):
                if not isinstance(outcome, Exception):
                    try:
                        outcome = self._chunk(sequence, outcome)
                    except Exception as error:  # detokenizing failed
                        outcome = error
                results.append((sequence, outcome))
        for sequence, outcome in results:
            if isinstance(outcome, Exception) or outcome.finish_reason:
                self.active.remove(sequence)
                if isinstance(outcome, Exception):
                    sequence.close()
                else:
                    sequence.last = outcome
                    self._finished.append(sequence)
        return results

    def keep_answers(self) -> None:
        """Cache the answers of the requests that finished in the last step for their conversations' next turns,
        then free their slots. Keeping one is a target pass over its last token and the template's end of message
        (LlamaCppRunner.keep_answer: 2-3 tokens, 44-53 ms on a 2-core Zen 4, docs/prefill-passes-zen4), which its
        client need not wait for: a caller that hands the finished chunks out first (the server's scheduler, a
        stream) calls this after; the next step() and close() call it in any case."""
        while self._finished:
            sequence = self._finished.pop(0)
            try:
                self.generator.keep_answer(sequence)
            except Exception as error:  # (the answer itself is complete): that reuse alone is lost
                log.warning("could not cache an answer for the next turn: %s", error)
            finally:
                sequence.close()

    @staticmethod
    def _chunk(sequence: Generation, step: Step) -> Chunk:
        chunk = sequence.output.chunk(step)
        if chunk.finish_reason == "stop" and step.finish_reason != "stop":  # a stop string, within the step
            sequence.decoding.stop_at(step, len(chunk.token_ids))
        elif chunk.finish_reason is None and sequence.decoding.done:  # (the engine's own end comes with a reason)
            chunk = sequence.output.end()
        return sequence.output.collect(chunk)

    def drop(self, sequence: Generation) -> None:
        """End a request early (its client left): its slot is free for the next."""
        if sequence in self.active:
            self.active.remove(sequence)
            sequence.close()

    def close(self) -> None:
        """The batch is over: the finished answers are kept, the requests still active end."""
        try:
            self.keep_answers()
        finally:
            for sequence in self.active:
                sequence.close()
            self.active = []


class _TenantsPool:
    """A batch's pool of a model as one tenant's drafter takes sequences from it (their prompts cached for that tenant
    alone: SequencePool.take)."""

    def __init__(self, pool: SequencePool, tenant: str | None):
        self.pool, self.tenant = pool, tenant

    def take(self, vocab_size: int) -> Runner:
        return self.pool.take(vocab_size, self.tenant)


def _k_policy(request: Request, drafter, priors: dict):
    if drafter.chooses_k:  # the drafter decides; k only caps it
        return make_k_policy(K_MAX if request.k == "auto" else request.k)
    # A seeded sample must not depend on the clock: k decides how the random stream is consumed.
    return make_k_policy(request.k, timed=not request.seeded_sample, **priors)
