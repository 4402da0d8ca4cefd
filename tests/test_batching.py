"""Batches: several sequences' cycles with their target passes fused, shaped by cost, and failures kept apart."""

from __future__ import annotations

import pytest
import torch

from specdec_exact.adaptive import FixedK
from specdec_exact.batching import batch_cycle, fused_forward, shape_pass
from specdec_exact.drafters import NoDrafter
from specdec_exact.engine import Decoding
from specdec_exact.runtimes.pytorch import TorchRunner
from specdec_exact.sampling import SamplingConfig, make_generator

from conftest import ToyRunner, draft_with, reference_greedy

GREEDY = SamplingConfig()
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 10, 11, 9, 9, 9]]




def batch_decode(target, drafters_and_ks, prompts, max_new_tokens, pass_cost):
    """Each prompt decoded greedily in one batch by batch_cycle (tiny torch runners: one pass per sequence) -> each
    one's tokens."""
    decodings = [Decoding(TorchRunner(target, target.config.vocab_size), drafter, torch.tensor([prompt]),
                          k=FixedK(k), max_new_tokens=max_new_tokens, sampling=GREEDY, generator=make_generator(0))
                 for (drafter, k), prompt in zip(drafters_and_ks, prompts)]
    tokens = [[] for _ in decodings]
    while live := [i for i, d in enumerate(decodings) if not d.done]:
        for i, step in zip(live, batch_cycle([decodings[i] for i in live], width=64, pass_cost=pass_cost)):
            tokens[i] += step.tokens
    return tokens


def sub_passes(items):
    """llama.cpp's fused pass with free width: one unit per sub-pass (per step in the widths)."""
    return float(len({n for _, n in items if n}))


def tokens_fed(items):
    """A pass that costs by its tokens alone: no draft token can pay for itself."""
    return float(sum(n for _, n in items))


@pytest.mark.parametrize("pass_cost", [sub_passes, tokens_fed])
def test_a_batch_shaped_by_its_pass_cost_gives_every_sequence_its_solo_greedy_output(models, pass_cost):
    """Drafts cut to nothing (a cost by tokens) or padded to the longest (a cost by sub-passes) leave every
    sequence's output as it is alone."""
    target = models["target"]
    drafters = [(draft_with(models["self"]), 4), (draft_with(models["random"]), 2), (NoDrafter(), 1),
                (draft_with(models["close"]), 3)]
    prompts = PROMPTS + [[4, 4, 2]]
    got = batch_decode(target, drafters, prompts, 17, pass_cost)
    assert got == [reference_greedy(target, prompt, 17) for prompt in prompts]


def test_shape_pass_pads_where_sub_passes_cost_and_cuts_where_tokens_do(models):
    """The shape: drafts of 1 and 3 tokens after a sub-pass cost -> both feed 4 tokens (one padded); after a cost by
    tokens, with nothing accepted yet -> plain decoding, 1 token each. The drafter hears only of its own tokens."""
    target = models["target"]
    for pass_cost, expected in ((sub_passes, [4, 4]), (tokens_fed, [1, 1])):
        decodings = [Decoding(TorchRunner(target, target.config.vocab_size), draft_with(models["self"]),
                              torch.tensor([PROMPTS[1]]), k=FixedK(k), max_new_tokens=10, sampling=GREEDY,
                              generator=make_generator(0)) for k in (1, 3)]
        for decoding in decodings:  # a first cycle without a pass: the prefill's token
            assert decoding.propose(max_width=1) is None
            decoding.commit(None)
        feeds = [decoding.propose() for decoding in decodings]
        shaped = shape_pass(decodings, feeds, 64, pass_cost)
        assert [feed.shape[1] for feed in shaped] == expected
        assert [decoding.n_drafted for decoding in decodings] == [min(1, expected[0] - 1), expected[1] - 1]


def test_a_fused_pass_holds_no_sequence_beyond_its_own_exact_width():
    """fused_forward groups sequences into passes of at most `width` tokens, and one whose runner says only one-token
    passes are exact where it stands (past the calibrated context) gets a pass of its own."""
    class Pool:
        def __init__(self):
            self.passes = []

        def forward_many(self, items):
            self.passes.append([runner.seq for runner, _ in items])
            return [runner.forward(tokens) for runner, tokens in items]

    class Slot(ToyRunner):
        def __init__(self, pool, seq, cached):
            super().__init__(vocab_size=6, seed=seq, max_length=64)
            self.pool, self.seq, self.tokens = pool, seq, [1] * cached

        def verify_width(self, length):
            return 1 if length >= 20 else 8

    model = Pool()
    runners = [Slot(model, seq, cached) for seq, cached in enumerate([5, 5, 30, 5, 5, 5])]
    one_token = torch.tensor([[2]])
    outputs = fused_forward([(runner, one_token) for runner in runners], width=4)
    assert model.passes == [[0, 1]] + [[3, 4, 5]]  # sequence 2 ran alone, by its own forward
    assert [o.shape for o in outputs] == [torch.Size([1, 1, 6])] * 6 and runners[2].calls == 1
    model.passes.clear()
    fused_forward([(runner, one_token) for runner in runners[:2] + runners[3:]], width=4)
    assert model.passes == [[0, 1, 3, 4]] and runners[5].calls == 2  # at most `width` tokens: 5 went on alone


class Faulty(ToyRunner):
    """A sequence whose passes fail from its n-th on (a fault in one sequence of a batch)."""

    def __init__(self, pool, seed, fail_from=None):
        super().__init__(vocab_size=6, seed=seed, max_length=64)
        self.pool, self.seq, self.fail_from = pool, seed, fail_from

    def forward(self, input_ids, last_only=False):
        if self.fail_from is not None and self.calls >= self.fail_from:
            self.calls += 1
            raise RuntimeError(f"sequence {self.seq} failed")
        return super().forward(input_ids, last_only)


class FusedPool:
    """A pool whose fused pass fails as a whole when any of its sequences fails (as one llama_decode does)."""

    def __init__(self):
        self.passes = 0

    def forward_many(self, items):
        self.passes += 1
        return [runner.forward(tokens) for runner, tokens in items]


def test_one_failing_sequence_ends_alone_while_seven_others_decode_on():
    """A fault in one sequence of eight: its cycle returns the error, the fused pass is run again one sequence at a
    time, and the seven others commit exactly what they commit without it."""
    def run(fault: bool):
        pool = FusedPool()
        decodings = [Decoding(Faulty(pool, seed, fail_from=3 if fault and seed == 5 else None), NoDrafter(),
                              torch.tensor([[1, 2]]), k=FixedK(1), max_new_tokens=8, sampling=GREEDY,
                              generator=make_generator(0)) for seed in range(8)]
        tokens, errors = [[] for _ in decodings], {}
        while live := [i for i, d in enumerate(decodings) if not d.done and i not in errors]:
            for i, outcome in zip(live, batch_cycle([decodings[i] for i in live], width=16)):
                if isinstance(outcome, Exception):
                    errors[i] = outcome
                else:
                    tokens[i] += outcome.tokens
        return tokens, errors

    clean, no_errors = run(fault=False)
    tokens, errors = run(fault=True)
    assert not no_errors and list(errors) == [5] and "sequence 5 failed" in str(errors[5])
    assert [t for i, t in enumerate(tokens) if i != 5] == [t for i, t in enumerate(clean) if i != 5]
    assert all(len(t) == 8 for i, t in enumerate(tokens) if i != 5)


def test_a_drafter_that_fails_ends_its_own_sequence_only():
    class Broken(NoDrafter):
        def propose(self, context, k, sampling, generator):
            raise ValueError("drafter broke")

    decodings = [Decoding(ToyRunner(seed=seed), Broken() if seed == 1 else NoDrafter(), torch.tensor([[1]]),
                          k=FixedK(1), max_new_tokens=4, sampling=GREEDY, generator=make_generator(0))
                 for seed in range(3)]
    outcomes = batch_cycle(decodings, width=8)
    assert isinstance(outcomes[1], ValueError) and not isinstance(outcomes[0], Exception)
    assert not isinstance(outcomes[2], Exception) and len(outcomes[2].tokens) == 1
