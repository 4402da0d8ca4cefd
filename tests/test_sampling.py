"""specdec_exact.sampling on its own: warping against transformers' logits processors, seeded sampling, bad input."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec_exact.sampling import SamplingConfig, argmax, logits_to_probs, make_generator, sample

from conftest import reference_probs

CONFIGS = [SamplingConfig(1.0), SamplingConfig(0.7), SamplingConfig(1.3, top_k=5), SamplingConfig(1.0, top_p=0.9),
           SamplingConfig(0.8, top_k=20, top_p=0.7), SamplingConfig(2.0, top_p=0.5), SamplingConfig(0.5, top_k=1)]


def transformers_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The same warping through transformers' processors, in the order its generate applies them."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(config.temperature)])
    if config.top_k is not None:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None:
        warpers.append(TopPLogitsWarper(config.top_p))
    return torch.softmax(warpers(None, logits.clone()), dim=-1)


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(16, 100, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3  # [rows, vocab]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_warping_matches_transformers_processors(logits, config):
    torch.testing.assert_close(logits_to_probs(logits, config), transformers_probs(logits, config).float(),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_warping_matches_the_plain_reference(logits, config):
    expected = torch.tensor([reference_probs(row, config) for row in logits], dtype=torch.float64)
    torch.testing.assert_close(logits_to_probs(logits, config).double(), expected, rtol=1e-5, atol=1e-7)


def test_top_k_and_top_p_keep_what_they_should():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (logits_to_probs(logits, SamplingConfig(1.0, top_k=2)) > 0).tolist() == [[True, True, False, False, False]]
    assert logits_to_probs(logits, SamplingConfig(1.0, top_p=1e-6)).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    # a top_p that float32 rounds to 0 (found by the API fuzzer: a NaN distribution, a 500) keeps the top token too
    assert logits_to_probs(logits, SamplingConfig(1.0, top_p=5e-324)).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    # so does a temperature so small that the logits divided by it overflow
    assert logits_to_probs(logits, SamplingConfig(5e-324)).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    assert (logits_to_probs(logits, SamplingConfig(1.0, top_k=50)) > 0).all()  # top_k beyond the vocabulary: all
    probs = logits_to_probs(logits, SamplingConfig(1.0))
    # top_p = the mass of the two most likely tokens exactly: the third is ranked after tokens holding top_p.
    nucleus = logits_to_probs(logits, SamplingConfig(1.0, top_p=float(probs[0, :2].sum()) + 1e-6))
    assert (nucleus > 0).tolist() == [[True, True, True, False, False]]


def test_greedy_has_no_probabilities_and_bad_settings_are_refused():
    with pytest.raises(ValueError, match="greedy"):
        logits_to_probs(torch.zeros(1, 4), SamplingConfig(0.0))
    for bad in (dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingConfig(**{"temperature": 1.0, **bad})


def test_the_same_seed_draws_the_same_tokens_and_no_seed_differs():
    probs = torch.full((64, 50), 1 / 50)
    first = sample(probs, make_generator(7))
    assert torch.equal(first, sample(probs, make_generator(7)))
    assert not torch.equal(sample(probs, make_generator(None)), sample(probs, make_generator(None)))


def test_sample_follows_the_distribution_and_the_check_catches_a_wrong_one():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    draws = sample(probs.expand(20_000, 5), make_generator(11))  # [draws]
    counts = torch.bincount(draws, minlength=5).double()
    assert chisquare(counts, probs.double() * 20_000).pvalue > 1e-3
    wrong = torch.tensor([0.45, 0.30, 0.15, 0.07, 0.03]).double()  # negative control: 5 points moved
    assert chisquare(counts, wrong * 20_000).pvalue < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_argmax_gives_torch_s_indices_ties_nan_infinities_and_strided_views_included(dtype):
    rows = torch.randn(6, 3, 1000, generator=torch.Generator().manual_seed(5)).to(dtype)
    rows[0, 0, 10] = rows[0, 0, 700] = 50  # a tie: the first
    rows[1, 1, :] = float("-inf")  # every token forbidden
    rows[2, 2, 3] = float("inf")
    rows[3, 0, 999] = float("nan")  # NaN counts as the maximum
    rows[4, 1, :] = 0  # all equal
    for logits in (rows, rows[..., :800], rows[:, 1], rows[0, 0], rows.transpose(0, 1)):
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    # negative control: the comparison sees a different index
    assert not torch.equal(argmax(rows[..., 1:]), rows.argmax(dim=-1))
