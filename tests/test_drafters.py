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

from specdec_exact.adaptive import AdaptiveK, FixedK
from specdec_exact.drafters import (DRAFTERS, Drafter, EarlyExitRunner, HybridDrafter, ModelDrafter, NgramDrafter,
                                    Proposal, SuffixDrafter, TargetInfo, build_drafter, early_exit_drafter, suffix_draft)
from specdec_exact.drafters.choice import ChoosingDrafter, Costs
from specdec_exact.drafters.suffix import SEPARATOR
from specdec_exact.engine import speculative_decode
from specdec_exact.generator import SpeculativeGenerator
from specdec_exact.metrics import SpecStats
from specdec_exact.runtimes.pytorch import TorchRunner
from specdec_exact.sampling import SamplingConfig, make_generator

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


def chooser(target, costs, close_noise: float | None = 0.01, min_gain: float = 1.0):
    """min_gain 1.0: any option that beats plain decoding at all is taken (what these tests of the choice's other
    rules measure against; the margin has its own tests)."""
    from conftest import close_draft

    model = draft_with(close_draft(target, noise=close_noise)) if close_noise is not None else None
    return ChoosingDrafter(SuffixDrafter(), model, costs, min_gain=min_gain)


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


def test_choosing_drafter_verifies_the_best_prefix_of_a_long_lookup_match(target):
    """Where each verified token costs a third of a step (llama.cpp with specdec's kernels), all 8 tokens of a long
    match are worth less than a plain step before any acceptance is seen, but its first tokens are worth more: the
    choice verifies that prefix, and drafts more once lookup has proved right."""
    moderate = Costs(verify=lambda width: 1.0 + 0.35 * (width - 1), draft_step=0.6)
    drafter = chooser(target, moderate, close_noise=None)
    decode(target, drafter, PROMPTS[1], 8)  # the answer is now in the suffix drafter's history
    _, stats = decode(target, drafter, PROMPTS[1], 8)
    assert cycles_by(stats, "suffix") > 0 and stats.accepted_tokens > 0
    assert stats.drafted_by_position[0] > stats.drafted_by_position[-1] > 0  # short at first, longer later


class MatchingLookup(Drafter):
    """A lookup that proposes the given tokens and says how long a suffix it matched, and what share of the matched
    occurrences went on with its first token (as SuffixDrafter does)."""

    name = "suffix"

    def __init__(self):
        self.tokens, self.last_match, self.last_agreement = [], 0, 1.0

    def propose(self, context, k, sampling, generator) -> Proposal:
        return Proposal(torch.tensor([self.tokens[:k]], dtype=torch.long))


def test_choosing_drafter_judges_a_lookup_by_its_match():
    """Where a verified token costs a third of a step, a guess after a one-token match whose occurrences went on in
    different ways (accepted about a fifth of the time, measured) is not worth verifying, one after a long match is;
    and what each band of match lengths and agreement earns stays its own. The negative control, one estimate for
    every lookup, verifies the split one-token match too."""
    from specdec_exact.drafters import choice

    moderate = Costs(verify=lambda width: 1.0 + 0.35 * (width - 1), draft_step=0.6)
    context, generator = torch.tensor([[5, 6, 7, 8]]), make_generator(0)

    def chosen(drafter, matched: int, agreement: float = 1.0) -> int:
        drafter.lookup.tokens, drafter.lookup.last_match = [9, 10, 11, 12], matched
        drafter.lookup.last_agreement = agreement
        return drafter.propose(context, 4, GREEDY, generator).tokens.shape[1]

    drafter = ChoosingDrafter(MatchingLookup(), None, moderate)
    assert chosen(drafter, 1, 0.5) == 0 and chosen(drafter, 3, 0.5) == 0
    assert chosen(drafter, 3) > 0 and chosen(drafter, 12) >= chosen(drafter, 3)
    for _ in range(6):  # long matches keep proving right ...
        n = chosen(drafter, 12)
        drafter.accept(n, n)
    assert chosen(drafter, 12) == 4 and chosen(drafter, 1, 0.5) == 0  # ... which earns a split match nothing
    for _ in range(6):  # two- and three-token matches keep failing: their band learns it, the long band does not
        drafter.accept(chosen(drafter, 2), 0)
    assert chosen(drafter, 2) == 0 and chosen(drafter, 12) == 4

    one_estimate = ChoosingDrafter(MatchingLookup(), None, moderate)
    one_estimate._lookup_estimate = lambda: "lookup"  # every lookup judged alike, as before the bands
    assert chosen(one_estimate, 1, 0.5) > 0
    assert choice.SPLIT_PRIOR < 0.35 < min(choice.MATCH_BANDS.values())


def test_a_draft_must_beat_plain_decoding_by_a_margin_and_lookups_not_verified_still_teach():
    """Where a pass over two tokens costs 1.36 one-token passes (as on an AMD EPYC Zen 4), a lookup after a one-token
    match, at its band's prior (0.45: 1.45 / 1.36 = 1.07 tokens a step), is not verified: a draft must beat plain
    decoding by MIN_GAIN. Negative control: without the margin it is. A lookup that was not verified still teaches
    its band: the token the plain step then produced was the lookup's, so the band's estimate rises and the next
    lookup is verified; where the plain steps produce other tokens it falls. Negative control: a chooser that does not
    learn from them never verifies the lookup."""
    from specdec_exact.drafters import choice

    zen4 = Costs(verify=lambda width: 1.0 + 0.36 * (width - 1), draft_step=0.7)
    generator = make_generator(0)

    def drafted(drafter, context: list[int]) -> int:
        drafter.lookup.tokens, drafter.lookup.last_match, drafter.lookup.last_agreement = [9], 1, 1.0
        return drafter.propose(torch.tensor([context]), 1, GREEDY, generator).tokens.shape[1]

    assert choice.MIN_GAIN > 1.45 / 1.36
    assert drafted(ChoosingDrafter(MatchingLookup(), None, zen4), [5, 6]) == 0
    assert drafted(ChoosingDrafter(MatchingLookup(), None, zen4, min_gain=1.0), [5, 6]) == 1

    def cycles(drafter, produced: int) -> list[int]:
        context, out = [5, 6], []
        for _ in range(3):
            out.append(drafted(drafter, context))
            context = context + [produced]  # the token the target produced at that position
        return out

    assert cycles(ChoosingDrafter(MatchingLookup(), None, zen4), produced=9)[:2] == [0, 1]
    failing = ChoosingDrafter(MatchingLookup(), None, zen4)
    assert cycles(failing, produced=4) == [0, 0, 0]
    assert failing.acceptance[("lookup", 1, True)].rate < choice.MATCH_BANDS[1]
    deaf = ChoosingDrafter(MatchingLookup(), None, zen4)
    deaf._learn_from_unverified = lambda context: None
    assert cycles(deaf, produced=9) == [0, 0, 0]


def test_the_choice_learns_what_wider_passes_cost_from_the_passes_it_is_served():
    """Calibrated at 1.2 one-token passes for two tokens, a lookup accepted 60% of the time (its prior) is worth
    verifying; once the served passes show that two tokens cost 2.0, it is not (the estimate moves from the
    calibration toward what the passes took, relative to the one-token passes around them). Forks share what they
    learn; a seeded sample's fork (by_calibration_alone) judges by the calibration alone. Negative control: with the
    calibrated costs alone it keeps drafting."""
    from specdec_exact.drafters.choice import ServedPassCosts

    def calibrated(width: int) -> float:
        return 1.0 + 0.2 * (width - 1)

    context, generator = torch.tensor([[5, 6, 7, 8]]), make_generator(0)

    def drafted(drafter) -> int:
        drafter.lookup.tokens, drafter.lookup.last_match, drafter.lookup.last_agreement = [9], 2, 1.0
        drafter.acceptance[("lookup", 2, True)].successes = drafter.acceptance[("lookup", 2, True)].trials = 0.0
        return drafter.propose(context, 1, GREEDY, generator).tokens.shape[1]

    served = ServedPassCosts(calibrated)
    parent = ChoosingDrafter(MatchingLookup(), None, Costs(served, 0.5))
    learning, seeded = parent.fork(), parent.fork(shared_history=False)
    seeded.by_calibration_alone = True  # (as a batch sets it for a seeded sample)
    seeded.lookup = learning.lookup = MatchingLookup()
    fixed = ChoosingDrafter(MatchingLookup(), None, Costs(calibrated, 0.5))
    assert served(2) == pytest.approx(1.2) and drafted(learning) == 1 and drafted(fixed) == 1
    for _ in range(40):  # the passes served: one-token ones at 30 ms, two-token ones at 60 ms
        learning.observe_pass(1, 0.030)
        learning.observe_pass(2, 0.060)
    assert served(2) > 1.7 and served(1) == 1.0
    assert drafted(learning) == 0 and drafted(parent.fork()) == 0  # forks share what the passes taught
    assert drafted(seeded) == 1 and drafted(fixed) == 1  # the seeded fork and the control judge by the calibration


def test_a_suffix_drafter_says_how_far_its_matched_occurrences_agreed():
    """last_agreement is the share of the matched occurrences that went on with the first draft token: 1.0 where
    every occurrence did, less where they split (the chooser judges such a lookup by an estimate of its own)."""
    drafter = SuffixDrafter()
    agreed = drafter.propose(torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]]), 2, GREEDY, make_generator(0))
    assert agreed.tokens.tolist() == [[3, 1]] and drafter.last_agreement == 1.0
    split = drafter.propose(torch.tensor([[1, 2, 1, 2, 1, 4, 1, 5, 1]]), 2, GREEDY, make_generator(0))
    assert split.tokens.tolist()[0][:1] == [2] and drafter.last_agreement == 0.5


def test_choosing_drafter_is_capped_by_the_engines_k(target):
    drafter = chooser(target, FLAT)
    _, stats = decode(target, drafter, PROMPTS[2], 2)
    assert stats.drafted_tokens > 0 and len(stats.drafted_by_position) <= 2


# --- self-speculation (early exit) -----------------------------------------------------------------------------------

def truncated_copy(model, n_layers):
    """The reference for an early exit: a copy of the model with only its first n_layers (test only: copies weights)."""
    short = copy.deepcopy(model)
    short.get_decoder().layers = short.get_decoder().layers[:n_layers]
    short.config.num_hidden_layers = n_layers
    return short


@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_early_exit_view_equals_a_truncated_model(target, n_layers):
    """Fed in pieces with a rollback in between, the view's logits equal the truncated model's over the whole row."""
    ids = torch.tensor([[4, 9, 1, 33, 2, 7, 7, 50]])
    with torch.inference_mode():
        expected = truncated_copy(target, n_layers)(ids).logits.float()  # [1, 8, vocab]
    runner = EarlyExitRunner(target, n_layers, target.config.vocab_size)
    first = runner.forward(ids[:, :5])
    runner.forward(torch.tensor([[60, 61]]))  # a rejected draft...
    runner.rollback(5)  # ...rolled back
    rest = runner.forward(ids[:, 5:])
    torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, rtol=0, atol=1e-5)
    assert runner.length == 8
    assert runner.forward(torch.tensor([[3]]), last_only=True).shape == (1, 1, target.config.vocab_size)


def test_early_exit_with_every_layer_is_the_model(target):
    ids = torch.tensor([[4, 9, 1, 33, 2]])
    full = TorchRunner(target, target.config.vocab_size).forward(ids)
    torch.testing.assert_close(EarlyExitRunner(target, 4, target.config.vocab_size).forward(ids), full)


def test_early_exit_shares_and_never_mutates_the_target(target):
    config_before = target.config.to_dict()
    layers_before = list(target.get_decoder().layers)
    drafter = early_exit_drafter(target, 2, target.config.vocab_size)
    decode(target, drafter, PROMPTS[1], 4)
    with pytest.raises(IndexError):  # an exception inside the view (a token past the embedding) changes nothing shared
        drafter.runner.forward(torch.tensor([[10_000]]))
    assert drafter.runner.decoder is target.get_decoder() and drafter.runner.model is target
    assert target.config.to_dict() == config_before and list(target.get_decoder().layers) == layers_before


@pytest.mark.parametrize("n_layers", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 4])
def test_self_speculation_greedy_equals_plain_greedy(target, n_layers, k):
    drafter, draft_model = DRAFTERS["self"](target_info(target), str(n_layers))
    assert draft_model is None and drafter.name == f"self:{n_layers}"
    for prompt in PROMPTS[1:3]:
        got, stats = decode(target, drafter, prompt, k)
        assert got == reference_greedy(target, prompt, NEW_TOKENS), (n_layers, k, prompt)
        assert stats.draft_calls > 0


@pytest.mark.parametrize("arg", ["0", "4", "9", "x"])
def test_self_refuses_a_layer_count_outside_1_to_layers_minus_1(target, arg):
    with pytest.raises(ValueError, match="self:N"):
        DRAFTERS["self"](target_info(target), arg)


@pytest.mark.parametrize("layers, default", [(2, 1), (4, 3), (8, 7), (16, 14), (28, 25)])
def test_self_without_a_number_leaves_out_the_last_eighth_of_the_layers(layers, default):
    model = tiny_model("qwen2", layers=layers)
    drafter, _ = DRAFTERS["self"](target_info(model), None)
    assert drafter.name == f"self:{default}"


# --- hybrid ----------------------------------------------------------------------------------------------------------

def test_hybrid_greedy_equals_plain_greedy_and_uses_both_branches(target):
    lookup, fallback = Spy(NgramDrafter()), Spy(draft_with(tiny_model(target.config.model_type, seed=1, layers=4)))
    for prompt in PROMPTS:
        for k in [1, 4]:
            got, _ = decode(target, HybridDrafter(lookup, fallback), prompt, k)
            assert got == reference_greedy(target, prompt, NEW_TOKENS), (k, prompt)
    assert lookup.used > 0 and fallback.used > 0


def test_hybrid_keeps_the_draft_models_cache_in_step_across_lookup_cycles(target):
    """With the target as its own draft model, every model proposal must be the target's greedy continuation of the
    context, also right after cycles where prompt lookup drafted and the draft model's cache was left behind."""
    fallback = draft_with(target)
    hybrid = HybridDrafter(NgramDrafter(), fallback)
    context = torch.tensor([PROMPTS[3]])
    hybrid.begin(context)
    branches = []
    for i in range(12):
        proposal = hybrid.propose(context, 3, GREEDY, make_generator(0))
        branches.append("model" if hybrid.last is fallback else "lookup")
        if hybrid.last is fallback:
            assert proposal.tokens[0].tolist() == reference_greedy(target, context[0].tolist(), 3), i
        hybrid.accept(proposal.tokens.shape[1], min(1, proposal.tokens.shape[1]))
        # Commit the first draft token and a recovered one: an unseen id leaves lookup nothing to match (the draft
        # model drafts next), a seen one gives it a match.
        recovered = 40 + i if i % 2 else 8
        context = torch.cat([context, proposal.tokens[:, :1], torch.tensor([[recovered]])], dim=1)
    assert branches == ["lookup", "lookup"] + ["model", "lookup"] * 5


def test_hybrid_by_name_loads_the_given_draft_model(target, tmp_path):
    draft = tiny_model(target.config.model_type, seed=1, layers=2)
    draft.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)  # as loaded for the draft (a qwen2 config adds a token)
    drafter, draft_model = build_drafter(f"hybrid:{tmp_path}", target_info(target, tokenizer))
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.lookup, NgramDrafter)
    assert draft_model.config.num_hidden_layers == 2 and draft_model.dtype == target.dtype
    got, _ = decode(target, drafter, PROMPTS[3], 4)
    assert got == reference_greedy(target, PROMPTS[3], NEW_TOKENS)


# --- adaptive k ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make_drafter", [lambda t: draft_with(tiny_model(t.config.model_type, seed=1, layers=4)),
                                          lambda t: draft_with(t), lambda t: NgramDrafter(),
                                          lambda t: early_exit_drafter(t, 2, t.config.vocab_size)],
                         ids=["random draft", "self draft", "ngram", "self:2"])
def test_adaptive_k_greedy_equals_plain_greedy(target, make_drafter):
    for prompt in PROMPTS[1:]:
        got, _ = decode(target, make_drafter(target), prompt, AdaptiveK())
        assert got == reference_greedy(target, prompt, NEW_TOKENS)


class Oracle(Drafter):
    """A free drafter that is always right: proposes the known greedy continuation (prompt lookup's ideal case)."""

    def __init__(self, prompt, continuation):
        self.full = torch.tensor([prompt + continuation])

    def propose(self, context, k, sampling, generator):
        return Proposal(self.full[:, context.shape[1]:context.shape[1] + k])


def test_adaptive_k_drafts_long_with_a_free_drafter_that_is_always_accepted(target):
    expected = reference_greedy(target, PROMPTS[1], 60)
    policy = AdaptiveK()
    got, stats = decode(target, Oracle(PROMPTS[1], expected), PROMPTS[1], policy, max_new_tokens=60)
    assert got == expected and stats.acceptance_rate == 1.0
    assert policy.next_k() == policy.k_max


# --- through the user-facing API -------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft", ["ngram", "ngram:2", "suffix", "suffix:4", "self:1", "self:3", "self"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_generator_by_drafter_name_equals_target_only(target, draft, k):
    baseline = SpeculativeGenerator(target, None).generate(PROMPTS[3], max_new_tokens=20)
    result = SpeculativeGenerator(target, draft, k).generate(PROMPTS[3], max_new_tokens=20)
    assert result.token_ids == baseline.token_ids == reference_greedy(target, PROMPTS[3], 20)


# --- sampling: chi-square against the target's exact distribution (tests/test_statistical.py) -------------------------

def early_exit_toy_draft():
    """A 6-token tiny transformer's first layer as the drafter of the toy target: the early-exit runner's q must
    be a proper distribution that the verifier corrects (toy and transformer do not share weights, which only makes
    rejections, the interesting path, more frequent)."""
    model = tiny_model("qwen2", seed=3, vocab_size=VOCAB, layers=2)
    return ModelDrafter(lambda: EarlyExitRunner(model, 1, VOCAB))


SAMPLING_CASES = {
    # The prompt ends in 1 4, seen before: lookup proposes 2 1 at the first cycle and keeps finding matches after.
    "ngram on a repetitive prompt, k=2, 3 tokens": (NgramDrafter, [1, 4, 2, 1, 4], 2, 3,
                                                    SamplingConfig(temperature=1.0)),
    # One draft forward per generation: a transformer forward is ~2 ms of Python overhead even this small, and
    # k=2, 3 tokens (~3.5 forwards) would take ~100 s; the cache-sync paths are covered by the greedy tests above.
    "early exit (self:1), k=1, 2 tokens, top-k 4": (early_exit_toy_draft, PROMPT, 1, 2,
                                                    SamplingConfig(temperature=0.9, top_k=4)),
    # The history of earlier samples (a short one, to stay quick) makes the drafts vary from generation to generation.
    "suffix with earlier requests, k=3, 3 tokens": (lambda: SuffixDrafter(max_history_tokens=60), [1, 4, 2, 1, 4], 3,
                                                    3, SamplingConfig(temperature=1.0)),
    # Lookup, the toy draft model and plain steps all take turns as their acceptance estimates move.
    "per-cycle choice (suffix, model, none), k=3, 3 tokens": (
        lambda: ChoosingDrafter(SuffixDrafter(max_history_tokens=60), toy_draft_model(),
                                Costs(lambda width: 1.0 + 0.1 * (width - 1), 0.1), min_gain=1.0),
        [1, 4, 2, 1, 4], 3, 3, SamplingConfig(temperature=1.0, top_p=0.9)),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_speculative_sampling_matches_target_distribution(case, monkeypatch):
    make_drafter, prompt, k, n_new, sampling = SAMPLING_CASES[case]
    monkeypatch.setattr(conftest, "PROMPT", prompt)  # read by both target_distribution and sample_sequences
    expected = target_distribution(ToyRunner(VOCAB, seed=0), n_new, sampling)
    drafter = Spy(make_drafter())
    counts = sample_sequences(lambda: drafter, k, n_new, sampling)
    assert drafter.used > DRAWS // 2  # the drafter did draft, in most generations at least
    assert chi_square_p_value(counts, expected) > ALPHA


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


def test_the_choice_replay_charges_a_copied_answer_fewer_passes_than_its_tokens():
    """benchmarks/choice_replay.py: an answer that copies a long stretch of its prompt is decoded in passes that cost
    fewer one-token passes than it has tokens (the lookups are drafted and accepted); an answer of tokens the prompt
    never holds costs exactly one one-token pass per token (nothing to look up)."""
    from benchmarks.choice_replay import replay

    def verify(width: int) -> float:
        return 1.0 + 0.3 * (width - 1)

    prompt = list(range(100, 160))
    assert replay(prompt, prompt[10:50], verify) < 0.6 * 40
    assert replay(prompt, list(range(200, 240)), verify) == pytest.approx(40.0)
