"""Every drafter is exact: greedy output equals target-only greedy; sampled output follows the target's distribution.

Also the early-exit view (a Runner over the target's first N layers) against a truncated copy of the model, and the
hybrid drafter's draft-model cache staying in step across cycles it sat out.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from specdec.adaptive import AdaptiveK, FixedK
from specdec.drafters import (DRAFTERS, Drafter, EarlyExitRunner, HybridDrafter, ModelDrafter, NgramDrafter,
                              Proposal, SuffixDrafter, TargetInfo, build_drafter, early_exit_drafter, suffix_draft)
from specdec.drafters.choice import ChoosingDrafter, Costs
from specdec.drafters.suffix import SEPARATOR
from specdec.engine import speculative_decode
from specdec.generator import SpeculativeGenerator
from specdec.metrics import SpecStats
from specdec.runtimes.pytorch import TorchRunner
from specdec.sampling import SamplingConfig, make_generator

import conftest
from conftest import (ALPHA, DRAWS, PROMPT, VOCAB, ToyRunner, char_tokenizer, chi_square_p_value, reference_greedy,
                      sample_sequences, target_distribution, tiny_model, toy_draft_model)

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingConfig()
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 10, 11, 9, 9, 9], [3, 8, 1, 3, 8, 2, 3, 8, 1, 3]]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return tiny_model(request.param, seed=0, layers=4)


def decode(target, drafter, prompt, k, max_new_tokens=NEW_TOKENS, sampling=GREEDY, seed=0):
    """-> (new tokens, stats); k is an int (FixedK) or a k policy."""
    stats = SpecStats()
    policy = FixedK(k) if isinstance(k, int) else k
    steps = speculative_decode(TorchRunner(target, target.config.vocab_size), drafter, torch.tensor([prompt]),
                               k=policy, max_new_tokens=max_new_tokens, sampling=sampling,
                               generator=make_generator(seed), stats=stats)
    return [t for step in steps for t in step.tokens], stats


def draft_with(model):
    return ModelDrafter(lambda: TorchRunner(model, model.config.vocab_size))


def target_info(model, tokenizer=None):
    return TargetInfo(model, tokenizer, model.config.vocab_size, model.dtype)


class Spy(Drafter):
    """Wraps a drafter and counts the proposals it made that were not empty."""

    def __init__(self, drafter):
        self.drafter, self.used, self.name = drafter, 0, drafter.name

    def begin(self, prompt_ids):
        self.drafter.begin(prompt_ids)

    def propose(self, context, k, sampling, generator):
        proposal = self.drafter.propose(context, k, sampling, generator)
        self.used += proposal.tokens.shape[1] > 0
        return proposal

    def accept(self, n_drafted, n_accepted):
        self.drafter.accept(n_drafted, n_accepted)


# --- prompt lookup ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 4, 8])
def test_ngram_greedy_equals_plain_greedy(target, k):
    drafted = 0
    for prompt in PROMPTS:
        got, stats = decode(target, NgramDrafter(), prompt, k)
        assert got == reference_greedy(target, prompt, NEW_TOKENS), (k, prompt)
        drafted += stats.drafted_tokens
    assert drafted > 0  # the repetitive prompts (and outputs) did give lookups something to propose


# --- suffix drafting -------------------------------------------------------------------------------------------------

def corpus(*documents) -> np.ndarray:
    """Documents joined with the separator, the last one being the current context."""
    return np.array([t for doc in documents[:-1] for t in [*doc, SEPARATOR]] + list(documents[-1]))


def test_suffix_draft_follows_the_longest_match_not_the_latest_short_one():
    # "1 2 3" was followed by 4 5; later "3" alone was followed by 9. The context ends in 1 2 3.
    draft, matched, _ = suffix_draft(corpus([1, 2, 3, 4, 5, 0, 3, 9, 7, 1, 2, 3]), k=2, min_probability=0.0)
    assert (draft, matched) == ([4, 5], 3)


def test_suffix_draft_takes_the_most_frequent_continuation_and_its_share():
    context = [7, 8, 1, 7, 8, 1, 7, 8, 2, 0, 7, 8]  # after 7 8: 1, 1, 2 -> 1 (2 of 3)
    draft, matched, probabilities = suffix_draft(corpus(context), k=1, min_probability=0.0)
    assert draft == [1] and matched == 2 and probabilities == [pytest.approx(2 / 3)]


def test_suffix_draft_stops_when_the_occurrences_disagree_too_much():
    context = [5, 1, 5, 2, 5, 3, 5, 4, 5]  # four different continuations of 5: 1/4 each
    assert suffix_draft(corpus(context), k=4, min_probability=0.3)[0] == []
    assert suffix_draft(corpus(context), k=1, min_probability=0.2)[0] == [1]  # ties: the smallest id


def test_suffix_draft_grows_with_the_match_and_never_crosses_a_document_boundary():
    earlier = list(range(10, 30))  # an earlier request's text
    assert suffix_draft(corpus(earlier, list(range(10, 16))), k=16) == (list(range(16, 22)), 6, [1.0] * 6)
    assert suffix_draft(corpus([4, 1], [9, 4]), k=8) == ([1], 1, [1.0])  # a one-token match drafts one token
    assert suffix_draft(corpus([1, 2], [2]), k=8) == ([], 1, [])  # 2 ended its document: nothing follows it
    assert suffix_draft(np.array([1, 2, 3]), k=3) == ([], 0, [])


@pytest.mark.parametrize("k", [1, 4, 8])
def test_suffix_greedy_equals_plain_greedy(target, k):
    drafter, drafted = SuffixDrafter(), 0
    for prompt in PROMPTS:
        got, stats = decode(target, drafter, prompt, k)
        assert got == reference_greedy(target, prompt, NEW_TOKENS), (k, prompt)
        drafted += stats.drafted_tokens
    assert drafted > 0


def test_suffix_remembers_earlier_requests():
    """The second time a prompt comes, the first answer is in the history: the drafter proposes it in long runs."""
    target = tiny_model("llama", seed=0, layers=2)
    drafter = SuffixDrafter()
    prompt = PROMPTS[1]
    first, first_stats = decode(target, drafter, prompt, 8)
    second, second_stats = decode(target, drafter, prompt, 8)
    assert second == first == reference_greedy(target, prompt, NEW_TOKENS)
    assert second_stats.accepted_tokens > first_stats.accepted_tokens + NEW_TOKENS // 2
    forgetful = SuffixDrafter(max_history_tokens=0)
    decode(target, forgetful, prompt, 8)
    assert decode(target, forgetful, prompt, 8)[1].accepted_tokens == first_stats.accepted_tokens


# --- the per-cycle choice of drafter and k ---------------------------------------------------------------------------

# A GPU-like verify pass (and draft model: catching up on many tokens costs little more than one step)
FLAT = Costs(verify=lambda width: 1.0 + 0.02 * (width - 1), draft_step=0.2, draft_token=0.01)
STEEP = Costs(verify=lambda width: float(width), draft_step=0.5)  # every extra token costs a whole pass


def chooser(target, costs, close_noise: float | None = 0.01):
    from conftest import close_draft

    model = draft_with(close_draft(target, noise=close_noise)) if close_noise is not None else None
    return ChoosingDrafter(SuffixDrafter(), model, costs)


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat verify", "steep verify"])
def test_choosing_drafter_greedy_equals_plain_greedy(target, costs):
    drafter = chooser(target, costs)
    for prompt in PROMPTS:
        got, _ = decode(target, drafter, prompt, 8)
        assert got == reference_greedy(target, prompt, NEW_TOKENS), prompt


def cycles_by(stats, name: str) -> int:
    """Cycles that the named option drafted (the engine records each proposal's source)."""
    return stats.by_drafter.get(name, [0])[0]


def test_choosing_drafter_drafts_nothing_where_no_option_can_pay(target):
    drafter = chooser(target, STEEP)
    _, stats = decode(target, drafter, PROMPTS[3], 8)
    assert stats.drafted_tokens == 0 and cycles_by(stats, "none") == stats.cycles


def test_choosing_drafter_uses_lookup_on_repeated_text_and_the_model_elsewhere(target):
    drafter = chooser(target, FLAT)
    decode(target, drafter, PROMPTS[1], 8)  # the answer is now in the suffix drafter's history
    _, stats = decode(target, drafter, PROMPTS[1], 8)
    assert cycles_by(stats, "suffix") > cycles_by(stats, "model") and stats.mean_accepted_length > 3
    _, stats = decode(target, drafter, [50, 7, 33], 8)  # nothing to look up: the close draft model drafts
    assert cycles_by(stats, "model") > cycles_by(stats, "suffix") and stats.accepted_tokens > 0


def test_choosing_drafter_catches_the_draft_model_up_only_where_that_pays(target):
    """A draft model that has not read a long prompt must take it all in before its first draft token. Where the
    model would gain a little over plain steps, that is never worth it in a short request; where it would gain a lot,
    it is after a few plain steps (their lost time pays for it); with catching up free, the model drafts at once."""
    import random

    prompt = random.Random(0).sample(range(3, 60), 50)  # no token twice: lookup finds nothing
    gains_a_little = Costs(lambda width: 1.0 + 0.4 * (width - 1), draft_step=0.1, draft_token=0.05)
    gains_a_lot = Costs(FLAT.verify, FLAT.draft_step, draft_token=0.05)  # 49 tokens behind: ~2.5 target steps
    free = Costs(FLAT.verify, FLAT.draft_step, draft_token=0.0)
    plain_steps = {}
    for name, costs in (("a little", gains_a_little), ("a lot", gains_a_lot), ("free", free)):
        _, stats = decode(target, chooser(target, costs), prompt, 8, max_new_tokens=60)
        plain_steps[name] = cycles_by(stats, "none")
        assert (cycles_by(stats, "model") > 0) == (name != "a little"), (name, stats.by_drafter)
    assert plain_steps["free"] <= 1 < plain_steps["a lot"] < plain_steps["a little"]


class RecordingRunner(TorchRunner):
    """A torch runner that records how many tokens each forward call took, and which."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fed: list[int] = []
        self.seen: list[int] = []

    def forward(self, input_ids, last_only=False):
        self.fed.append(input_ids.shape[1])
        self.seen += input_ids[0].tolist()
        return super().forward(input_ids, last_only=last_only)


class PassByPassRunner(RecordingRunner):
    """Its prefill goes in passes of PIECE tokens, yielding between them, as llama.cpp's runner does along a prompt's
    segments."""

    PIECE = 8

    def prefill(self, input_ids):
        for start in range(0, input_ids.shape[1], self.PIECE):
            if start:
                yield
            logits = self.forward(input_ids[:, start:start + self.PIECE], last_only=True)
        return logits


def test_choosing_drafter_reads_a_long_prompt_a_pass_per_cycle_where_others_wait(target):
    """Once the draft model is worth catching up, it takes the prompt in one prefill pass per cycle where other
    requests wait on this one's passes (a batch says so), the cycles going on with plain steps or lookups meanwhile;
    alone, all at once, drafting in the same cycle. The output is the target's either way. Negative control: a runner
    that cannot prefill pass by pass reads it in one cycle."""
    import random

    from conftest import close_draft

    prompt = random.Random(0).sample(range(3, 60), 50)  # no token twice: lookup finds nothing
    free = Costs(FLAT.verify, FLAT.draft_step, draft_token=0.0)
    draft = close_draft(target)
    # (the first draft also feeds what the plain steps added while the model read)
    for kind, others_waiting, spread in ((PassByPassRunner, True, True), (PassByPassRunner, False, False),
                                         (RecordingRunner, True, False)):
        runners = []

        def make_runner(kind=kind):
            runners.append(kind(draft, draft.config.vocab_size))
            return runners[-1]

        drafter = ChoosingDrafter(SuffixDrafter(), ModelDrafter(make_runner), free)
        drafter.others_waiting = others_waiting
        fed_per_cycle, propose = [], drafter.propose

        def counting(*args, **kwargs):
            before = sum(runners[-1].fed) if runners else 0
            proposal = propose(*args, **kwargs)
            fed_per_cycle.append(sum(runners[-1].fed) - before)
            return proposal

        drafter.propose = counting
        got, stats = decode(target, drafter, prompt, 8, max_new_tokens=40)
        assert got == reference_greedy(target, prompt, 40)
        assert cycles_by(stats, "model") > 0, kind.__name__
        case = (kind.__name__, others_waiting, fed_per_cycle)
        assert (max(fed_per_cycle) <= 2 * PassByPassRunner.PIECE) == spread, case
        if spread:  # the prompt's passes in successive cycles, plain steps meanwhile
            assert fed_per_cycle[:6] == [PassByPassRunner.PIECE] * 6, case
            assert cycles_by(stats, "none") + cycles_by(stats, "suffix") >= 6, case
        else:  # all of it in the first cycle, which drafts too (a step a token beyond the prompt)
            assert fed_per_cycle[0] > len(prompt), case


def test_forks_of_a_model_drafter_read_ahead_one_at_a_time(target):
    """Two requests of a batch whose draft model must read a prompt: the second waits until the first has read
    all of its own (llama.cpp's prefill passes share one context per model), then reads; closing a reader mid-way
    hands the turn on."""
    from conftest import close_draft

    draft = close_draft(target)
    parent = ModelDrafter(lambda: PassByPassRunner(draft, draft.config.vocab_size))
    first, second, third = parent.fork(), parent.fork(), parent.fork()
    context = torch.tensor([list(range(3, 3 + 3 * PassByPassRunner.PIECE + 1))])
    for fork in (first, second, third):
        fork.begin(context)
    assert not first.read_ahead(context) and not second.read_ahead(context)
    assert second.runner.fed == []  # waiting its turn
    while not first.read_ahead(context):
        assert second.runner.fed == []
    assert first.tokens_behind(context) == 1
    assert not second.read_ahead(context) and second.runner.fed == [PassByPassRunner.PIECE]
    assert not third.read_ahead(context) and third.runner.fed == []
    second.close()  # a client left mid-way: the next one reads
    assert not third.read_ahead(context) and third.runner.fed == [PassByPassRunner.PIECE]
