"""Choosing k: the pure choice from acceptance and costs, then AdaptiveK learning them from observed cycles."""

from __future__ import annotations

import pytest

from specdec_exact.adaptive import AdaptiveK, FixedK, best_k, expected_tokens, make_k_policy


def flat(seconds: float = 1.0):
    """A verify cost that does not grow with width (Leviathan et al.'s model)."""
    return lambda width: seconds


def sloped(seconds: float, slope: float):
    return lambda width: seconds * (1 + slope * (width - 1))


@pytest.mark.parametrize("a, k, expected", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.5, 3, 1.875)])
def test_expected_tokens(a, k, expected):
    assert expected_tokens(a, k) == pytest.approx(expected)


# (acceptance, draft cost per token, verify cost, k_max) -> k
CHOICES = {
    "free draft, flat verify: as many as allowed": (0.8, 0.0, flat(), 8, 8),
    "free draft, verify grows with width: fewer": (0.8, 0.0, sloped(1.0, 0.2), 8, 4),
    "low acceptance: k = 1": (0.1, 0.1, flat(), 8, 1),
    "nothing accepted: k = 1": (0.0, 0.0, flat(), 8, 1),
    "high acceptance, cheap draft": (0.9, 0.05, flat(), 8, 8),
    "high acceptance, expensive draft": (0.9, 0.5, flat(), 8, 3),
    "a = 0.7, c = 0.1": (0.7, 0.1, flat(), 8, 4),
    "k_max caps": (0.99, 0.0, flat(), 3, 3),
    "k_max 1": (0.9, 0.0, flat(), 1, 1),
}


@pytest.mark.parametrize("case", list(CHOICES))
def test_best_k_table(case):
    a, draft_cost, verify_cost, k_max, k = CHOICES[case]
    assert best_k(a, draft_cost, verify_cost, k_max) == k


def test_best_k_is_leviathans_optimum_under_a_flat_verify_cost():
    for a in [0.3, 0.5, 0.7, 0.9]:
        for c in [0.01, 0.1, 0.3]:
            speedups = {k: (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)) for k in range(1, 9)}
            assert best_k(a, c * 0.2, flat(0.2), 8) == max(speedups, key=speedups.get)


def test_best_k_grows_with_acceptance_and_shrinks_with_draft_cost():
    by_acceptance = [best_k(a / 10, 0.1, flat(), 8) for a in range(10)]
    assert by_acceptance == sorted(by_acceptance) and by_acceptance[0] == 1 and by_acceptance[-1] > 4
    by_cost = [best_k(0.8, c / 10, flat(), 8) for c in range(10)]
    assert by_cost == sorted(by_cost, reverse=True) and by_cost[0] == 8


def run_cycles(policy: AdaptiveK, accept, draft_s_per_token: float, verify_s: float = 0.1,
               verify_slope: float = 0.02, cycles: int = 30) -> list[int]:
    """Feed cycles with acceptance accept(k) and timings from the given costs -> the k chosen each cycle."""
    chosen = []
    for _ in range(cycles):
        k = policy.next_k()
        chosen.append(k)
        policy.observe(k, accept(k), draft_s_per_token * k, verify_s * (1 + verify_slope * k))
    return chosen


def test_adaptive_k_rises_when_everything_is_accepted():
    chosen = run_cycles(AdaptiveK(), accept=lambda k: k, draft_s_per_token=0.005)
    assert chosen[-1] == 8 and chosen[-1] > chosen[0]


def test_adaptive_k_falls_to_plain_decoding_when_nothing_is_accepted_and_probes_ever_less_often():
    chosen = run_cycles(AdaptiveK(probe_every=4), accept=lambda k: 0, draft_s_per_token=0.02, cycles=80)
    assert set(chosen[10:]) == {0, 1}
    probes = [i for i, k in enumerate(chosen) if i >= 10 and k == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 8 * 4 + 1  # the interval doubles up to 8x probe_every


def test_best_k_is_zero_where_a_wider_verify_costs_more_than_it_yields():
    """Measured on 2 CPU cores with llama.cpp: a pass over 2 tokens costs 1.8 one-token passes, a draft step 0.5."""
    def cpu(width):
        return 1.0 + 0.8 * (width - 1)

    assert best_k(0.8, 0.5, cpu, 8, k_min=0) == 0
    assert best_k(0.8, 0.5, cpu, 8) == 1  # without the option, k >= 1 as before
    assert best_k(0.95, 0.0, flat(), 8, k_min=0) == 8  # a free, accurate drafter on a flat verify


def test_no_probes_where_even_a_perfect_drafter_would_lose():
    """The costs measured for the 0.5B draft and the 1.5B target on llama.cpp, 2 cores: c = 0.48, slope 0.78."""
    policy = AdaptiveK(prior_draft_cost=0.48, prior_verify_slope=0.78)
    assert [policy.next_k() for _ in range(100)] == [0] * 100
    free = AdaptiveK(prior_draft_cost=0.0, prior_verify_slope=0.78)  # prompt lookup may still pay: it probes
    assert 1 in [free.next_k() for _ in range(100)]


def test_adaptive_k_chooses_plain_decoding_where_speculation_cannot_pay():
    chosen = run_cycles(AdaptiveK(), accept=lambda k: k, draft_s_per_token=0.05, verify_slope=0.9, cycles=60)
    assert chosen[-20:].count(0) >= 15


def test_adaptive_k_expensive_draft_gets_a_smaller_k_than_a_free_one():
    """Same acceptance (about 3 of every draft accepted); a prompt-lookup-like free drafter vs a costly draft model."""
    free = run_cycles(AdaptiveK(), accept=lambda k: min(k, 3), draft_s_per_token=0.0)
    costly = run_cycles(AdaptiveK(), accept=lambda k: min(k, 3), draft_s_per_token=0.05)
    assert free[-1] > costly[-1] >= 1


def test_adaptive_k_recovers_after_acceptance_returns():
    policy = AdaptiveK()
    run_cycles(policy, accept=lambda k: 0, draft_s_per_token=0.005)
    assert policy.next_k() == 1
    chosen = run_cycles(policy, accept=lambda k: k, draft_s_per_token=0.005)
    assert chosen[-1] == 8


def test_acceptance_counts_only_tested_tokens():
    """After the first rejection the remaining draft tokens were never tested: 2 of 8 accepted is 2 of 3 trials."""
    policy = AdaptiveK(prior_weight=1e-9)
    policy.observe(8, 2, 0.01, 0.1)
    assert policy.acceptance == pytest.approx(2 / 3)
    policy.observe(0, 0, 0.001, 0.1)  # nothing drafted: nothing learnt about acceptance
    assert policy.acceptance == pytest.approx(2 / 3)


def test_first_cycles_draft_time_is_not_a_per_token_cost():
    """It includes the drafter's prefill of the prompt."""
    policy = AdaptiveK(prior_draft_cost=0.1)
    policy.observe(4, 4, 10.0, 0.2)
    assert policy.draft_cost == pytest.approx(0.1 * policy.verify_cost(1))
    policy.observe(4, 4, 0.04, 0.2)
    assert policy.draft_cost == pytest.approx(0.01)


def test_verify_cost_learns_a_slope_from_varied_widths():
    policy = AdaptiveK(prior_verify_slope=0.0)
    for width in [1, 3, 5, 9] * 10:
        policy.observe(width - 1, 0, 0.0, 0.1 + 0.01 * (width - 1))
    assert policy.verify_cost(1) == pytest.approx(0.1, rel=0.05)
    assert policy.verify_cost(9) == pytest.approx(0.18, rel=0.05)


def test_each_request_starts_fresh():
    first = make_k_policy("auto")
    run_cycles(first, accept=lambda k: 0, draft_s_per_token=0.02)
    second = make_k_policy("auto")
    assert isinstance(second, AdaptiveK) and second is not first
    assert second.next_k() == AdaptiveK().next_k() != first.next_k()


def test_make_k_policy_still_builds_fixed_k():
    assert isinstance(make_k_policy(3), FixedK) and make_k_policy("5").next_k() == 5


@pytest.mark.parametrize("bad", [dict(k_max=0), dict(prior_acceptance=1.5), dict(decay=0.0), dict(prior_weight=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        AdaptiveK(**bad)
