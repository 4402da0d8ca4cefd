"""Invariants of the decoding loop on tiny random transformers: speculative greedy == plain greedy, token for token."""

from __future__ import annotations

import pytest
import torch

from specdec.adaptive import FixedK
from specdec.drafters import ModelDrafter, NoDrafter
from specdec.engine import Decoding, batch_cycle, shape_pass, speculative_decode
from specdec.metrics import SpecStats
from specdec.runners import TorchRunner
from specdec.sampling import SamplingConfig, make_generator

from conftest import ToyRunner, close_draft, tiny_model

GREEDY = SamplingConfig()
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 10, 11, 9, 9, 9]]


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: set[int] = frozenset()) -> list[int]:
    """Plain greedy without any cache: the whole sequence through the model for every token."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token in eos:
                break
            ids.append(token)
    return ids[len(prompt):]


def decode(target, drafter, prompt, k, max_new_tokens, eos=frozenset(), sampling=GREEDY, seed=0):
    stats = SpecStats()
    steps = list(speculative_decode(TorchRunner(target, target.config.vocab_size), drafter, torch.tensor([prompt]),
                                    k=FixedK(k), max_new_tokens=max_new_tokens, sampling=sampling,
                                    generator=make_generator(seed), eos_ids=frozenset(eos), stats=stats))
    return [t for step in steps for t in step.tokens], steps, stats


def draft_with(model):
    return ModelDrafter(lambda: TorchRunner(model, model.config.vocab_size))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    target = tiny_model(request.param, seed=0)
    return {"target": target, "self": target, "random": tiny_model(request.param, seed=1),
            "close": close_draft(target)}


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
    from specdec.engine import fused_forward

    class Model:
        def __init__(self):
            self.passes = []

        def forward_many(self, items):
            self.passes.append([runner.seq for runner, _ in items])
            return [runner.forward(tokens) for runner, tokens in items]

    class Slot(ToyRunner):
        def __init__(self, model, seq, cached):
            super().__init__(vocab_size=6, seed=seq, max_length=64)
            self.model, self.seq, self.tokens = model, seq, [1] * cached

        def verify_width(self, length):
            return 1 if length >= 20 else 8

    model = Model()
    runners = [Slot(model, seq, cached) for seq, cached in enumerate([5, 5, 30, 5, 5, 5])]
    one_token = torch.tensor([[2]])
    outputs = fused_forward([(runner, one_token) for runner in runners], width=4)
    assert model.passes == [[0, 1]] + [[3, 4, 5]]  # sequence 2 ran alone, by its own forward
    assert [o.shape for o in outputs] == [torch.Size([1, 1, 6])] * 6 and runners[2].calls == 1
    model.passes.clear()
    fused_forward([(runner, one_token) for runner in runners[:2] + runners[3:]], width=4)
    assert model.passes == [[0, 1, 3, 4]] and runners[5].calls == 2  # at most `width` tokens: 5 went on alone
