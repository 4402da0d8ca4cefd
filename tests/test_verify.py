"""Exactness of verification, analytically: enumerate every accept/reject branch and compare with p."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_exact.verify import acceptance_probs, greedy_verify, rejection_sample, residual_probs


def distributions(vocab: int, rows: int):
    """Random distributions [rows, vocab] with exact zeros allowed (q = 0 where p > 0 and the reverse)."""
    weight = st.one_of(st.just(0.0), st.floats(0.01, 10.0))
    return st.lists(st.lists(weight, min_size=vocab, max_size=vocab).filter(lambda r: sum(r) > 0),
                    min_size=rows, max_size=rows).map(
        lambda r: (lambda t: t / t.sum(-1, keepdim=True))(torch.tensor(r, dtype=torch.float64)))


def emitted_distribution(p: torch.Tensor, q: torch.Tensor | None) -> dict[tuple[int, ...], float]:
    """Probability of every emitted sequence of one verify cycle, by enumerating drafts and accept/reject branches
    with the verifier's own acceptance and residual functions. p [k+1, vocab], q [k, vocab] (None: one-hot drafts of
    token 0 at every position)."""
    k, vocab = p.shape[0] - 1, p.shape[1]
    out: dict[tuple[int, ...], float] = {}
    drafts = itertools.product(range(vocab), repeat=k) if q is not None else [(0,) * k]
    for draft in drafts:
        tokens = torch.tensor([draft])
        prob_draft = float(np.prod([q[i, t] for i, t in enumerate(draft)])) if q is not None else 1.0
        if prob_draft == 0:
            continue
        accept = acceptance_probs(tokens, None if q is None else q[None], p[None])[0]
        prob_prefix = prob_draft
        for n in range(k + 1):  # n draft tokens accepted, then the recovered (n < k) or bonus (n == k) token
            if n < k:
                draft_row = q[n] if q is not None else torch.nn.functional.one_hot(tokens[0, n], vocab).double()
                branch = prob_prefix * (1 - float(accept[n]))
            else:
                draft_row, branch = torch.zeros(vocab, dtype=p.dtype), prob_prefix
            last = residual_probs(p[n], draft_row)
            for y in range(vocab):
                key = tuple(draft[:n]) + (y,)
                out[key] = out.get(key, 0.0) + branch * float(last[y])
            if n < k:
                prob_prefix *= float(accept[n])
    return out


def check_chain_is_target(p: torch.Tensor, emitted: dict[tuple[int, ...], float]) -> None:
    """Each emitted token must follow p at its position given the tokens before it: P(prefix + y) summed over all
    continuations, divided by P(the prefix was accepted), equals p_i(y)."""
    k = p.shape[0] - 1
    assert sum(emitted.values()) == pytest.approx(1.0, abs=1e-9)
    for length in range(1, k + 2):
        # mass of emitted sequences that start with a given prefix of `length` tokens
        starts: dict[tuple[int, ...], float] = {}
        for seq, prob in emitted.items():
            if len(seq) >= length:
                starts[seq[:length]] = starts.get(seq[:length], 0.0) + prob
        # the first length-1 tokens were accepted drafts; condition on them
        by_prefix: dict[tuple[int, ...], float] = {}
        for seq, prob in starts.items():
            by_prefix[seq[:-1]] = by_prefix.get(seq[:-1], 0.0) + prob
        for seq, prob in starts.items():
            # P(prefix, y) == P(prefix accepted) * p(y), compared unconditioned so that tiny masses stay stable
            assert prob == pytest.approx(by_prefix[seq[:-1]] * float(p[length - 1, seq[-1]]), abs=1e-7)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5).flatmap(lambda v: st.tuples(distributions(v, 2), distributions(v, 1))))
def test_single_position_emits_exactly_p(pq):
    p, q = pq  # p [2, vocab]: the draft position and the bonus position
    emitted = emitted_distribution(p, q)
    first = torch.zeros(p.shape[1], dtype=torch.float64)
    for seq, prob in emitted.items():
        first[seq[0]] += prob
    assert torch.allclose(first, p[0], atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4).flatmap(lambda v: st.integers(1, 3).flatmap(
    lambda k: st.tuples(distributions(v, k + 1), distributions(v, k)))))
def test_chain_of_k_positions_emits_exactly_p(pq):
    p, q = pq
    check_chain_is_target(p, emitted_distribution(p, q))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5).flatmap(lambda v: st.integers(1, 3).flatmap(lambda k: distributions(v, k + 1))))
def test_deterministic_drafter_one_hot_q_emits_exactly_p(p):
    check_chain_is_target(p, emitted_distribution(p, None))


def test_rejection_sample_matches_the_enumeration_empirically():
    """The sampler itself (not only its branch formulas): 200,000 rows in one batched call."""
    torch.manual_seed(0)
    vocab, k, rows = 4, 2, 200_000
    p = torch.softmax(torch.randn(k + 1, vocab, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(k, vocab, dtype=torch.float64) * 2, -1)
    draft = torch.multinomial(q, rows, replacement=True).T  # [rows, k]
    generator = torch.Generator().manual_seed(1)
    tokens, n_accepted = rejection_sample(draft, q.expand(rows, k, vocab), p.expand(rows, k + 1, vocab), generator)
    expected = emitted_distribution(p, q)
    counts: dict[tuple[int, ...], int] = {}
    for row, n in zip(tokens.tolist(), n_accepted.tolist()):
        key = tuple(row[: n + 1])
        counts[key] = counts.get(key, 0) + 1
    for seq, prob in expected.items():
        sd = (prob * (1 - prob) / rows) ** 0.5
        assert abs(counts.get(seq, 0) / rows - prob) < 5 * sd + 1e-4, seq


def test_wrong_acceptance_rule_is_caught_by_the_enumeration():
    """Negative control for the analytic check: accepting every draft token must fail it."""
    p = torch.tensor([[0.7, 0.2, 0.1], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.1, 0.8]], dtype=torch.float64)
    wrong = {}
    for x in range(3):
        for y in range(3):
            wrong[(x, y)] = float(q[0, x] * p[1, y])
    with pytest.raises(AssertionError):
        check_chain_is_target(p, wrong)


@pytest.mark.parametrize("draft, argmax, expected_n", [
    ([1, 2, 3], [1, 2, 3, 4], 3),  # all accepted: bonus token 4
    ([1, 2, 3], [1, 0, 3, 4], 1),  # first mismatch at position 1: recovered token 0
    ([5, 2, 3], [1, 2, 3, 4], 0),  # nothing accepted
    ([], [7], 0),  # no draft: one plain target step
])
def test_greedy_verify_table(draft, argmax, expected_n):
    vocab = 8
    logits = torch.nn.functional.one_hot(torch.tensor([argmax]), vocab).double()  # [1, k+1, vocab]
    tokens, n = greedy_verify(torch.tensor([draft], dtype=torch.long).reshape(1, -1), logits)
    assert int(n[0]) == expected_n
    assert tokens[0, : expected_n + 1].tolist() == draft[:expected_n] + [argmax[expected_n]]


def test_greedy_verify_rows_are_independent():
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3], [1, 5, 3]]), 8).double()
    tokens, n = greedy_verify(torch.tensor([[1, 2], [1, 2]]), logits)
    assert n.tolist() == [2, 1]
    assert tokens[1, :2].tolist() == [1, 5]
