"""Prompt lookup: table tests of the pure matching function, then the drafter behind the protocol."""

from __future__ import annotations

import pytest
import torch

from specdec_exact.drafters import DRAFTERS, NgramDrafter, find_continuation
from specdec_exact.sampling import SamplingConfig, make_generator

# (context, k, max_ngram, min_ngram) -> expected proposal
CASES = {
    "no match": ([1, 2, 3, 4], 3, 3, 1, []),
    "empty context": ([], 3, 3, 1, []),
    "single token": ([7], 3, 3, 1, []),
    "bigram match, k tokens follow": ([1, 2, 3, 4, 5, 6, 1, 2], 3, 3, 1, [3, 4, 5]),
    "several matches: the most recent wins": ([5, 1, 8, 5, 1, 9, 5, 1], 2, 3, 1, [9, 5]),
    "match near the end gives fewer than k": ([1, 2, 3, 1, 2], 4, 3, 1, [3, 1, 2]),
    "match runs up to the end (overlapping repeat)": ([4, 4, 4], 5, 3, 1, [4]),
    "longest n first, even if a shorter one is more recent": ([1, 2, 3, 9, 7, 3, 8, 1, 2, 3], 2, 3, 1, [9, 7]),
    "falls back to a shorter n": ([6, 3, 5, 0, 2, 3], 2, 3, 1, [5, 0]),
    "min_ngram refuses short matches": ([6, 3, 5, 0, 2, 3], 2, 3, 2, []),
    "max_ngram caps the suffix": ([1, 2, 3, 9, 7, 3, 8, 1, 2, 3], 2, 1, 1, [8, 1]),
    "k = 0": ([1, 2, 1], 0, 3, 1, []),
    "k = 1": ([1, 2, 3, 1, 2], 1, 3, 1, [3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_find_continuation_table(case):
    tokens, k, max_ngram, min_ngram, expected = CASES[case]
    assert find_continuation(tokens, k, max_ngram, min_ngram) == expected
    assert find_continuation(torch.tensor(tokens, dtype=torch.long), k, max_ngram, min_ngram) == expected


def test_find_continuation_matches_a_brute_force_scan():
    """Random contexts over a small vocabulary (many matches) against the definition, written as a plain loop."""
    def brute(tokens, k, max_ngram, min_ngram):
        for n in range(max_ngram, min_ngram - 1, -1):
            if n >= len(tokens):
                continue
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tokens[-n:]:
                    return tokens[start + n:start + n + k]
        return []

    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        length = int(torch.randint(0, 30, (1,), generator=generator))
        tokens = torch.randint(0, 4, (length,), generator=generator).tolist()
        for max_ngram, min_ngram in [(3, 1), (4, 2), (1, 1)]:
            assert find_continuation(tokens, 5, max_ngram, min_ngram) == brute(tokens, 5, max_ngram, min_ngram)


@pytest.mark.parametrize("bad", [dict(k=-1), dict(min_ngram=0), dict(max_ngram=2, min_ngram=3)])
def test_find_continuation_refuses_bad_settings(bad):
    args = dict(k=2, max_ngram=3, min_ngram=1) | bad
    with pytest.raises(ValueError):
        find_continuation([1, 2, 1], **args)


def test_find_continuation_refuses_a_batch():
    with pytest.raises(ValueError, match="1-D"):
        find_continuation(torch.tensor([[1, 2, 1]]), 2)


def test_drafter_proposes_the_continuation_deterministically():
    drafter = NgramDrafter()
    context = torch.tensor([[1, 2, 3, 4, 1, 2]])
    drafter.begin(context)
    for sampling in [SamplingConfig(), SamplingConfig(temperature=1.0)]:
        proposal = drafter.propose(context, 3, sampling, make_generator(0))
        assert proposal.tokens.tolist() == [[3, 4, 1]] and proposal.tokens.dtype == torch.long
        assert proposal.probs is None and proposal.forward_calls == 0


def test_drafter_proposes_nothing_without_a_match():
    proposal = NgramDrafter().propose(torch.tensor([[1, 2, 3]]), 4, SamplingConfig(), make_generator(0))
    assert proposal.tokens.shape == (1, 0) and proposal.tokens.dtype == torch.long


@pytest.mark.parametrize("arg, max_ngram", [(None, 3), ("5", 5), ("1", 1)])
def test_registered_by_name_with_max_ngram(arg, max_ngram):
    drafter, draft_model = DRAFTERS["ngram"](None, arg)
    assert isinstance(drafter, NgramDrafter) and drafter.max_ngram == max_ngram and draft_model is None


@pytest.mark.parametrize("arg", ["0", "x", "-2"])
def test_bad_name_argument_is_refused(arg):
    with pytest.raises(ValueError, match="ngram:N"):
        DRAFTERS["ngram"](None, arg)
