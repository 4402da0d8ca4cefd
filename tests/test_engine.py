"""Invariants of the decoding loop on tiny random transformers: speculative greedy == plain greedy, token for token."""

from __future__ import annotations

import pytest
import torch

from specdec_exact.adaptive import FixedK
from specdec_exact.drafters import NoDrafter
from specdec_exact.engine import Decoding, speculative_decode
from specdec_exact.metrics import SpecStats
from specdec_exact.runtimes.pytorch import TorchRunner
from specdec_exact.sampling import SamplingConfig, make_generator

from conftest import ToyRunner, draft_with, reference_greedy, tiny_model

GREEDY = SamplingConfig()
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 10, 11, 9, 9, 9]]


def decode(target, drafter, prompt, k, max_new_tokens, eos=frozenset(), sampling=GREEDY, seed=0):
    stats = SpecStats()
    steps = list(speculative_decode(TorchRunner(target, target.config.vocab_size), drafter, torch.tensor([prompt]),
                                    k=FixedK(k), max_new_tokens=max_new_tokens, sampling=sampling,
                                    generator=make_generator(seed), eos_ids=frozenset(eos), stats=stats))
    return [t for step in steps for t in step.tokens], steps, stats




@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("draft", ["self", "random", "close"])
def test_speculative_greedy_equals_plain_greedy(models, draft, k):
    for prompt in PROMPTS:
        expected = reference_greedy(models["target"], prompt, 24)
        got, _, stats = decode(models["target"], draft_with(models[draft]), prompt, k, 24)
        assert got == expected, (draft, k, prompt)
        assert stats.new_tokens == 24


def test_target_only_baseline_equals_reference(models):
    for prompt in PROMPTS:
        got, _, stats = decode(models["target"], NoDrafter(), prompt, 4, 16)
        assert got == reference_greedy(models["target"], prompt, 16)
        assert stats.drafted_tokens == 0 and stats.cycles == 16


def test_target_as_its_own_draft_accepts_everything(models):
    _, steps, stats = decode(models["target"], draft_with(models["self"]), PROMPTS[1], 4, 25)
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_length == 5.0  # k accepted + the bonus token, every cycle
    assert [len(s.tokens) for s in steps] == [5] * 5
    assert all(s.n_from_draft == 4 for s in steps)


def test_random_draft_is_mostly_rejected(models):
    _, _, stats = decode(models["target"], draft_with(models["random"]), PROMPTS[1], 4, 24)
    assert stats.acceptance_rate < 0.5
    assert stats.mean_accepted_length == 24 / stats.cycles  # every cycle's tokens were emitted, none cut off


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 11])
def test_max_new_tokens_inside_an_accepted_run_is_never_exceeded(models, max_new_tokens):
    expected = reference_greedy(models["target"], PROMPTS[1], max_new_tokens)
    got, steps, _ = decode(models["target"], draft_with(models["self"]), PROMPTS[1], 4, max_new_tokens)
    assert got == expected
    assert steps[-1].finish_reason == "length"


def test_eos_inside_an_accepted_run_stops_there(models):
    full = reference_greedy(models["target"], PROMPTS[1], 20)
    eos = full[6]  # a token the target emits in the middle of a 5-token accepted run
    expected = reference_greedy(models["target"], PROMPTS[1], 20, {eos})
    got, steps, _ = decode(models["target"], draft_with(models["self"]), PROMPTS[1], 4, 20, eos={eos})
    assert got == expected and eos not in got
    assert steps[-1].finish_reason == "stop"


def test_context_limit_ends_with_length():
    target = tiny_model("llama", seed=0, max_positions=12)
    got, steps, _ = decode(target, draft_with(target), PROMPTS[1], 4, 50)
    assert len(PROMPTS[1]) + len(got) == 12
    assert steps[-1].finish_reason == "length"


def test_draft_sees_the_recovered_token_before_its_next_proposal(models):
    """After a rejection the drafter's cache must be rolled back and extended with the recovered token; a drafter
    that kept stale keys would still produce correct output (the target decides) but a self-draft would stop
    being accepted. So: a self-draft after a forced rejection keeps acceptance 1 from the next cycle on."""
    target = models["target"]
    drafter = draft_with(target)
    drafter.begin(torch.tensor([PROMPTS[1]]))
    context = torch.tensor([PROMPTS[1]])
    drafter.propose(context, 4, GREEDY, make_generator(0))  # caches context + 3 draft tokens
    recovered = torch.tensor([[3]])  # pretend the target rejected everything and emitted 3
    context = torch.cat([context, recovered], dim=1)
    proposal = drafter.propose(context, 4, GREEDY, make_generator(0))
    assert proposal.tokens[0].tolist() == reference_greedy(target, context[0].tolist(), 4)


def test_no_token_asked_for_evaluates_nothing():
    """max_new_tokens 0: done at once, without a prefill of the prompt (no target pass, no drafter begun)."""
    target = ToyRunner()
    decoding = Decoding(target, NoDrafter(), torch.tensor([[1, 2, 3]]), k=FixedK(2), max_new_tokens=0,
                        sampling=GREEDY, generator=make_generator(0))
    assert decoding.done and target.calls == 0 and target.length == 0


def test_a_failed_verification_rolls_the_target_back_to_before_its_pass(models, monkeypatch):
    """Whatever fails between the pass and the commit, the target's cache holds what it held before the pass."""
    import specdec_exact.engine as engine

    target = TorchRunner(models["target"], models["target"].config.vocab_size)
    decoding = Decoding(target, draft_with(models["self"]), torch.tensor([PROMPTS[1]]), k=FixedK(3),
                        max_new_tokens=10, sampling=GREEDY, generator=make_generator(0))
    decoding.commit(target.forward(decoding.propose()))  # one good cycle
    before = target.length
    feed = decoding.propose()
    logits = target.forward(feed)
    assert target.length == before + feed.shape[1]

    def broken(*args):
        raise RuntimeError("verification failed")

    monkeypatch.setattr(engine, "greedy_verify", broken)
    with pytest.raises(RuntimeError, match="verification failed"):
        decoding.commit(logits)
    assert target.length == before
