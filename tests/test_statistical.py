"""Statistical identity: sequences sampled speculatively follow the target's exact sequence distribution.

The target and the draft are toy exact models (tests/conftest.py ToyRunner) with a 6-token vocabulary, so the
target's distribution over every 2-3 token continuation can be enumerated and compared by chi-square.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import specdec_exact.engine
from specdec_exact.adaptive import FixedK
from specdec_exact.adjust import LogitAdjust
from specdec_exact.drafters import Drafter, Proposal
from specdec_exact.sampling import SamplingConfig, logits_to_probs, make_generator, sample

from conftest import (ALPHA, DRAWS, PROMPT, VOCAB, ToyRunner, chi_square_p_value, reference_probs, sample_sequences,
                      target_distribution, toy_draft_model)

pytestmark = pytest.mark.usefixtures("one_thread")


class RepeatDrafter(Drafter):
    """A deterministic drafter (no q): proposes the last context token k times, i.e. one-hot q."""

    def propose(self, context, k, sampling, generator):
        return Proposal(context[:, -1:].repeat(1, k))




CASES = {
    "temperature 1, k=2, 3 tokens": (toy_draft_model, 2, 3, SamplingConfig(temperature=1.0)),
    "temperature 0.7 + top-k 3, k=3, 2 tokens": (toy_draft_model, 3, 2, SamplingConfig(temperature=0.7, top_k=3)),
    "top-p 0.8, k=1, 3 tokens": (toy_draft_model, 1, 3, SamplingConfig(temperature=1.0, top_p=0.8)),
    "deterministic drafter (one-hot q), k=2, 3 tokens": (RepeatDrafter, 2, 3, SamplingConfig(temperature=1.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(case):
    make_drafter, k, n_new, sampling = CASES[case]
    expected = target_distribution(ToyRunner(VOCAB, seed=0), n_new, sampling)
    counts = sample_sequences(make_drafter, k, n_new, sampling)
    assert chi_square_p_value(counts, expected) > ALPHA


def accept_everything(draft_tokens, draft_probs, target_probs, generator):
    """A deliberately wrong verifier: keeps every draft token, then samples the bonus token from p."""
    k = draft_tokens.shape[1]
    bonus = sample(target_probs[:, k], generator)
    return torch.cat([draft_tokens, bonus[:, None]], dim=1), torch.full((draft_tokens.shape[0],), k)


@pytest.mark.parametrize("case", ["temperature 1, k=2, 3 tokens", "top-p 0.8, k=1, 3 tokens"])
def test_negative_control_wrong_verifier_is_detected(case, monkeypatch):
    """The same test has the power to catch a verifier that does not correct the draft."""
    monkeypatch.setattr(specdec_exact.engine, "rejection_sample", accept_everything)
    make_drafter, k, n_new, sampling = CASES[case]
    expected = target_distribution(ToyRunner(VOCAB, seed=0), n_new, sampling)
    counts = {s: c for s, c in sample_sequences(make_drafter, k, n_new, sampling).items()}
    rare = {s for s, p in expected.items() if p == 0}
    # Either it samples sequences the target never emits, or the frequencies are off.
    assert set(counts) & rare or chi_square_p_value(counts, expected) < ALPHA


def ignore_top_k(logits, sampling):
    """A deliberately wrong warper: forgets top-k."""
    return logits_to_probs(logits, SamplingConfig(sampling.temperature, None, sampling.top_p))


def test_negative_control_wrong_warping_is_detected(monkeypatch):
    """The oracle is independent of specdec_exact.sampling: a warping bug shows up as a distribution mismatch."""
    monkeypatch.setattr(specdec_exact.engine, "logits_to_probs", ignore_top_k)
    make_drafter, k, n_new, sampling = CASES["temperature 0.7 + top-k 3, k=3, 2 tokens"]
    expected = target_distribution(ToyRunner(VOCAB, seed=0), n_new, sampling)
    counts = sample_sequences(make_drafter, k, n_new, sampling)
    rare = {s for s, p in expected.items() if p == 0}
    assert set(counts) & rare or chi_square_p_value(counts, expected) < ALPHA


def sub_passes(items: list[tuple[object, int]]) -> float:
    """A fused pass that costs by its sub-passes (one per step in the runners' widths), as on llama.cpp, with each
    sub-pass free of its width: batch_cycle's shape_pass then pads every draft to the longest."""
    return float(len({n for _, n in items if n}))


def sample_sequences_in_batches(n_new: int, sampling: SamplingConfig, batch: int = 4, pass_cost=None,
                                ks=(1, 2, 3)) -> dict[tuple[int, ...], int]:
    """DRAWS sequences, decoded `batch` at a time by batch_cycle: deterministic and model drafters in turn, with the
    ks in turn, so that every cycle mixes proposals of different lengths and acceptance is ragged (with pass_cost
    sub_passes: the shorter drafts padded; ks (2, 1): every model draft)."""
    from specdec_exact.batching import batch_cycle
    from specdec_exact.engine import Decoding

    counts: dict[tuple[int, ...], int] = {}
    generator = make_generator(4321)
    for _ in range(DRAWS // batch):
        decodings = [Decoding(ToyRunner(VOCAB, seed=0), toy_draft_model() if i % 2 else RepeatDrafter(),
                              torch.tensor([PROMPT]), k=FixedK(ks[i % len(ks)]), max_new_tokens=n_new,
                              sampling=sampling, generator=generator) for i in range(batch)]
        tokens: list[list[int]] = [[] for _ in decodings]
        while live := [i for i, d in enumerate(decodings) if not d.done]:
            for i, step in zip(live, batch_cycle([decodings[i] for i in live], width=64, pass_cost=pass_cost)):
                tokens[i] += step.tokens
        for seq in tokens:
            counts[tuple(seq)] = counts.get(tuple(seq), 0) + 1
    return counts


@pytest.mark.parametrize("pass_cost", [None, sub_passes], ids=["ragged", "padded"])
def test_sampling_inside_a_batch_matches_target_distribution(pass_cost):
    sampling = SamplingConfig(temperature=1.0)
    expected = target_distribution(ToyRunner(VOCAB, seed=0), 3, sampling)
    counts = sample_sequences_in_batches(3, sampling, pass_cost=pass_cost, ks=(2, 1) if pass_cost else (1, 2, 3))
    assert chi_square_p_value(counts, expected) > ALPHA


@pytest.mark.parametrize("pass_cost", [None, sub_passes], ids=["ragged", "padded"])
def test_negative_control_a_wrong_verifier_inside_a_batch_is_detected(monkeypatch, pass_cost):
    monkeypatch.setattr(specdec_exact.engine, "rejection_sample", accept_everything)
    sampling = SamplingConfig(temperature=1.0)
    expected = target_distribution(ToyRunner(VOCAB, seed=0), 3, sampling)
    counts = sample_sequences_in_batches(3, sampling, pass_cost=pass_cost)
    rare = {s for s, p in expected.items() if p == 0}
    assert set(counts) & rare or chi_square_p_value(counts, expected) < ALPHA


def test_negative_control_padding_with_a_wrong_q_is_detected(monkeypatch):
    """Padding is exact only because each filler token is proposed with q = 1 on it: a filler given the uniform q
    instead (as if drawn at random) is caught."""
    def padded_with_uniform_q(self, token, n):
        filler = token.expand(-1, n)
        probs = self.probs
        if probs is not None:
            uniform = torch.full((probs.shape[0], n, probs.shape[2]), 1.0 / probs.shape[2], dtype=probs.dtype)
            probs = torch.cat([probs, uniform], dim=1)
        return dataclasses.replace(self, tokens=torch.cat([self.tokens, filler], dim=1), probs=probs)

    monkeypatch.setattr(Proposal, "padded", padded_with_uniform_q)
    sampling = SamplingConfig(temperature=1.0)
    expected = target_distribution(ToyRunner(VOCAB, seed=0), 3, sampling)
    counts = sample_sequences_in_batches(3, sampling, pass_cost=sub_passes, ks=(2, 1))
    rare = {s for s, p in expected.items() if p == 0}
    assert set(counts) & rare or chi_square_p_value(counts, expected) < ALPHA


# Drafting across vocabularies (drafters.cross_vocab). The target's tokenizer has a b c ab ca <eos> (6 tokens, the
# ToyRunner's vocabulary); the draft's c b a bc ab abc <eos>: bc and abc are not the target's, and the draft puts
# about a third of its mass on them, which the shared-vocabulary method must give up without bias.
CROSS_TARGET = ("abc", [("a", "b"), ("c", "a")])
CROSS_DRAFT = ("cba", [("b", "c"), ("a", "b"), ("ab", "c")])


def cross_vocab_drafter(drafter_class=None):
    from specdec_exact.drafters.cross_vocab import CrossVocabDrafter, Vocabularies

    from conftest import byte_bpe_tokenizer

    target, draft = byte_bpe_tokenizer(*CROSS_TARGET), byte_bpe_tokenizer(*CROSS_DRAFT)
    assert len(target) == VOCAB
    vocab = Vocabularies(target, len(target), draft, len(draft))
    make = lambda: ToyRunner(len(draft), seed=99, scale=2.0)  # noqa: E731
    return (drafter_class or CrossVocabDrafter)(make, vocab)


def test_cross_vocabulary_sampling_matches_target_distribution():
    sampling = SamplingConfig(temperature=1.0)
    expected = target_distribution(ToyRunner(VOCAB, seed=0), 3, sampling)
    counts = sample_sequences(cross_vocab_drafter, 2, 3, sampling)
    assert chi_square_p_value(counts, expected) > ALPHA


def test_negative_control_cross_vocabulary_q_by_draft_ids_is_detected(monkeypatch):
    """The method has to map q to the target's ids: a q left on the draft's ids (read as if the vocabularies were
    one) is caught."""
    from specdec_exact.drafters.cross_vocab import Vocabularies

    def by_draft_ids(self, draft_probs):
        return draft_probs[..., : self.target_size]
    monkeypatch.setattr(Vocabularies, "to_target", by_draft_ids)
    sampling = SamplingConfig(temperature=1.0)
    expected = target_distribution(ToyRunner(VOCAB, seed=0), 3, sampling)
    assert chi_square_p_value(sample_sequences(cross_vocab_drafter, 2, 3, sampling), expected) < ALPHA


def test_negative_control_cross_vocabulary_q_not_renormalised_is_detected():
    """The draft samples among the shared tokens, so q must be its distribution restricted to them and
    renormalised; reporting its unrestricted probabilities instead (the mass outside left out) is caught."""
    from specdec_exact.drafters.cross_vocab import CrossVocabDrafter

    class Unrenormalised(CrossVocabDrafter):
        def draft(self, context, k, sampling, generator, allowed=None):
            tokens, probs = super().draft(context, k, sampling, generator, allowed)
            seen = tuple(self.cached_ids[0, : context.shape[1]].tolist())
            for i, token in enumerate(tokens[0].tolist()):
                full = logits_to_probs(self.runner.logits_after(seen), sampling)
                probs[0, i] = full * allowed
                seen += (token,)
            return tokens, probs

    sampling = SamplingConfig(temperature=1.0)
    expected = target_distribution(ToyRunner(VOCAB, seed=0), 3, sampling)
    counts = sample_sequences(lambda: cross_vocab_drafter(Unrenormalised), 2, 3, sampling)
    assert chi_square_p_value(counts, expected) < ALPHA


class NoRepeat:
    """A toy grammar over token ids, with specdec_exact.grammar.Constraint's interface: no token twice in a row. Its
    mask at a position depends on the token before it, so at a draft position on the draft token before (ignore_draft:
    the mistake of masking every row of a pass as its first, which the test must catch)."""

    def __init__(self, last: int, ignore_draft: bool = False):
        self.last, self.ignore_draft = last, ignore_draft

    def masks(self, fed: list[int], rows: int) -> torch.Tensor:
        before = [self.last] + ([self.last] * len(fed) if self.ignore_draft else list(fed))
        allowed = torch.ones(rows, VOCAB, dtype=torch.bool)
        for j in range(rows):
            allowed[j, before[j]] = False
        return allowed

    def commit(self, tokens: list[int]) -> None:
        self.last = tokens[-1] if tokens else self.last


def constrained_distribution(n_new: int, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """Exact probability of every n_new-token continuation of PROMPT when no token may repeat the one before."""
    runner, out = ToyRunner(VOCAB, seed=0), {}
    for seq in itertools.product(range(VOCAB), repeat=n_new):
        prob, before = 1.0, PROMPT[-1]
        for i, token in enumerate(seq):
            logits = runner.logits_after(tuple(PROMPT) + seq[:i]).clone()
            logits[before] = float("-inf")
            prob *= reference_probs(logits, sampling)[token]
            before = token
        out[seq] = prob
    return out


@pytest.mark.parametrize("ignore_draft", [False, True])
def test_constrained_sampling_matches_the_masked_target_distribution(ignore_draft):
    """A grammar's target distribution is the masked one, and a draft position is masked as after the draft tokens
    before it: speculative samples under a toy grammar follow the exactly enumerated masked distribution (draft model
    and k=2, 3 tokens). Negative control: rows masked as the pass's first are caught."""
    sampling, n_new = SamplingConfig(temperature=1.0), 3
    expected = constrained_distribution(n_new, sampling)
    generator, drafter, counts = make_generator(99), toy_draft_model(), {}
    for _ in range(DRAWS):
        steps = specdec_exact.engine.speculative_decode(
            ToyRunner(VOCAB, seed=0), drafter, torch.tensor([PROMPT]), k=FixedK(2), max_new_tokens=n_new,
            sampling=sampling, generator=generator, constraint=NoRepeat(PROMPT[-1], ignore_draft))
        seq = tuple(t for step in steps for t in step.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    if not ignore_draft:
        assert chi_square_p_value(counts, expected) > ALPHA
        return
    try:
        passed = chi_square_p_value(counts, expected) > ALPHA
    except AssertionError:  # it sampled a sequence the grammar forbids
        passed = False
    assert not passed


def penalised_distribution(n_new: int, sampling: SamplingConfig, adjust: LogitAdjust) -> dict[tuple[int, ...], float]:
    """Exact probability of every n_new-token continuation of PROMPT under the target with these penalties."""
    runner, out = ToyRunner(VOCAB, seed=0), {}
    for seq in itertools.product(range(VOCAB), repeat=n_new):
        prob = 1.0
        for i, token in enumerate(seq):
            logits = adjust.rows(runner.logits_after(tuple(PROMPT) + seq[:i])[None], list(seq[:i]), [])[0]
            prob *= reference_probs(logits, sampling)[token]
        out[seq] = prob
    return out


@pytest.mark.parametrize("ignore_draft", [False, True])
def test_penalised_sampling_matches_the_penalised_target_distribution(ignore_draft, monkeypatch):
    """Presence and frequency penalties at a draft position count the draft tokens before it: speculative samples
    follow the exactly enumerated penalised distribution (draft model, k=2, 3 tokens). Negative control: penalties
    that count only the tokens committed before the pass are caught."""
    sampling, n_new, adjust = SamplingConfig(temperature=1.0), 3, LogitAdjust(presence=1.5, frequency=1.0)
    expected = penalised_distribution(n_new, sampling, adjust)
    if ignore_draft:
        rows = LogitAdjust.rows
        monkeypatch.setattr(LogitAdjust, "rows", lambda self, logits, generated, fed: torch.cat(
            [rows(self, logits[j:j + 1], generated, []) for j in range(logits.shape[0])]))
    generator, drafter, counts = make_generator(7), toy_draft_model(), {}
    for _ in range(DRAWS):
        steps = specdec_exact.engine.speculative_decode(
            ToyRunner(VOCAB, seed=0), drafter, torch.tensor([PROMPT]), k=FixedK(2), max_new_tokens=n_new,
            sampling=sampling, generator=generator, adjust=adjust)
        seq = tuple(t for step in steps for t in step.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    assert (chi_square_p_value(counts, expected) > ALPHA) != ignore_draft
