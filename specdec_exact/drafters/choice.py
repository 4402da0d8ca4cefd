"""Choosing, every cycle, how to speculate: suffix lookup, the draft model, or not at all, and how far.

Each option's expected tokens per second of target time is estimated from the costs (a target pass over w tokens, a
draft-model step, both in target steps: calibrated at load, the passes' then learned from the passes served,
ServedPassCosts) and from the acceptance each option has had so far in this request (Leviathan et al. 2023, eq. 1: a
cycle of k draft tokens accepted with probability a each emits (1 - a^(k+1)) / (1 - a) tokens). Lookup costs nothing
to try, so its proposal is made first and weighed as it is; the draft model's k is the best for its acceptance; plain
decoding yields one token per one-token pass. A draft is verified only where it beats plain decoding by MIN_GAIN, and
a lookup that was not verified still teaches its estimate: the token a plain step then produced says whether its
first token would have been accepted. A seeded sample's choice uses no clock (the calibrated costs alone), so
that it repeats exactly.

A draft model must first take in what it has not read (the whole prompt the first time it drafts in a request). That
cost is paid out of the regret, the target time lost so far to cycles where a caught-up model would have done better,
and what the regret does not cover counts against the model: a model that would gain a little is never caught up on
a long prompt, one that gains a lot soon is (the ski-rental rule: rent until the rent paid would have bought skis).
Once chosen, the model reads the prompt a pass of its prefill per cycle (ModelDrafter.read_ahead) while the cycles
go on with the other options, where other requests of a batch wait on this one's passes (others_waiting): they never
wait for a whole prompt's reading. Alone, it reads it at once and drafts in the same cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdec_exact.adaptive import Acceptance, best_k, expected_tokens
from specdec_exact.drafters.base import Drafter, Proposal

# A lookup's acceptance depends on how long a suffix of the context it matched (`last_match` of a suffix drafter),
# and on whether the earlier occurrences of that suffix all went on with the token it drafts first (`last_agreement`).
# Measured with the default target on 25 prompts of the packaged workloads that the benchmarks do not use (HumanEval,
# ASDiv and XSum from the 21st on; greedy target-only output replayed, a suffix lookup after every token, 1,864
# lookups): where the occurrences agreed, the first draft token was accepted after 53% of one-token matches, 63% of
# 2-3-token, 69% of 4-7-token and 95% of longer ones; where they disagreed (the drafter then follows the most frequent
# continuation), after 18-34% in every band. So the choice keeps one acceptance estimate per band of match lengths
# (lower bounds here) and agreement, each starting from its own prior: a split lookup is rarely worth a wider pass,
# and a one-token match does not borrow the credit that long ones earn.
# matched tokens (at least) -> prior acceptance per draft token where the occurrences agreed (the measured rates,
# rounded down)
MATCH_BANDS = {1: 0.45, 2: 0.6, 4: 0.7, 8: 0.9}
SPLIT_PRIOR = 0.2  # prior acceptance of a lookup whose matched occurrences went on in different ways, in any band
# A draft is verified only where its expected tokens per unit of target time beat plain decoding's by this factor. The
# estimates it stands on (an acceptance from a prior and a few cycles, pass costs that move by a few percent between
# moments of a shared machine) are not finer than that, and on open chat the lookups chosen on thinner margins lost:
# 24-26 cycles a request at 25-40% acceptance made the default 0.93-0.97x of --draft none's tokens/s (AMD EPYC Zen 4,
# 2 cores, python -m benchmarks servers: docs/servers-zen4-lookup-only), where copying answers (code edits,
# summaries) ran at 1.47-1.67x of it.
MIN_GAIN = 1.1


class ServedPassCosts:
    """What a target pass over w tokens costs, in one-token passes, as this process's own passes show it: the
    calibration's figure at first (measured once at load over a short context, where on a shared machine a busy
    moment moves it), then the decayed mean of each width's passes over the one-token passes around them, at the
    context lengths of the requests served. A draft is verified only where its expected tokens pay for the pass it
    widens, so a ratio set too low makes drafts that lose. Callable as Costs.verify; passes come in through observe()
    (batching.batch_cycle, passes of one sequence)."""

    def __init__(self, calibrated: Callable[[int], float], prior_weight: float = 8.0, decay: float = 0.98):
        self.calibrated, self.prior_weight, self.decay = calibrated, prior_weight, decay
        self.one_token_s: float | None = None  # decayed mean seconds of the recent one-token passes
        self._ratios: dict[int, list[float]] = {}  # width -> [decayed sum of time / one_token_s, decayed count]

    def observe(self, width: int, seconds: float) -> None:
        """A pass of one sequence over `width` tokens took `seconds`."""
        if width == 1:
            self.one_token_s = seconds if self.one_token_s is None else 0.8 * self.one_token_s + 0.2 * seconds
        elif width > 1 and self.one_token_s is not None:
            sums = self._ratios.setdefault(width, [0.0, 0.0])
            sums[0] = self.decay * sums[0] + seconds / self.one_token_s
            sums[1] = self.decay * sums[1] + 1.0

    def __call__(self, width: int) -> float:
        prior = self.calibrated(width)
        sums = self._ratios.get(width)
        if width <= 1 or sums is None:
            return prior
        return (sums[0] + self.prior_weight * prior) / (sums[1] + self.prior_weight)


@dataclass(frozen=True)
class Costs:
    """Costs in units of one one-token target pass."""
    verify: Callable[[int], float]  # a target pass over w tokens (draft tokens + 1): calibrated, or ServedPassCosts
    draft_step: float  # one draft-model step
    # One token fed to the draft model within a longer pass, as when it catches up with the context (the whole
    # prompt the first time it drafts in a request); None: a step per token, the cautious guess.
    draft_token: float | None = None


def best(options: dict[str, tuple[float, int, float]], min_gain: float) -> str:
    """The option with the most expected tokens per unit of target time (ties: the first, plain decoding), where it
    beats plain decoding ("none") by min_gain; else plain decoding."""
    choice = max(options, key=lambda name: options[name][0])
    return choice if options[choice][0] >= min_gain * options["none"][0] else "none"


class ChoosingDrafter(Drafter):
    """Per cycle, the option with the most expected tokens per unit of target time: `lookup`'s proposal, `model`
    drafting its best k, or nothing (a plain target step), a draft only where it beats plain decoding by min_gain.
    k from the engine is a cap."""

    name = "auto"
    chooses_k = True  # the engine's k is only a cap: this drafter decides how many tokens to draft

    def __init__(self, lookup: Drafter, model: Drafter | None, costs: Costs,
                 prior_acceptance: float = 0.6,  # cautious: Leviathan et al. 2023 measure 0.5-0.9 for same-family pairs
                 prior_weight: float = 2.0, decay: float = 0.9, min_gain: float = MIN_GAIN):
        self.lookup, self.model_drafter, self.costs, self.min_gain = lookup, model, costs, min_gain
        self.prior = (prior_acceptance, prior_weight, decay)
        self.begin(None)

    def begin(self, prompt_ids) -> None:
        """A new request: its estimates start from the priors (a request's choices depend on it alone, so that the
        same seeded request gives the same sample whatever ran before)."""
        if prompt_ids is not None:
            self.lookup.begin(prompt_ids)
            if self.model_drafter is not None:
                self.model_drafter.begin(prompt_ids)
        _, weight, decay = self.prior
        self.acceptance = {name: Acceptance(*self.prior) for name in ("lookup", "model")}
        self.acceptance.update({("lookup", band, agreed): Acceptance(prior if agreed else SPLIT_PRIOR, weight, decay)
                                for band, prior in MATCH_BANDS.items() for agreed in (True, False)})
        self.chosen: str | None = None  # what the target is verifying: "lookup", "model" or None
        self.estimate: str | tuple | None = None  # the acceptance estimate the chosen proposal is judged by
        self.regret = 0.0  # target steps lost to not drafting with a caught-up model (see the module's docstring)
        self.reading = False  # the model is taking in the prompt, a pass per cycle (paid for: it drafts when done)
        # A lookup proposed where the cycle decoded plainly: (the context's length then, its estimate, its first
        # token). The next cycle's context holds the token the target produced there, which tells whether that first
        # token would have been accepted (a lookup drafts its token for certain, so it is accepted with the
        # probability the target gives it, which is the chance a plain step produces it, greedy or sampled): the
        # estimate learns while its lookups are not drafted
        self.unverified: tuple[int, str | tuple, int] | None = None

    def propose(self, context, k, sampling, generator) -> Proposal:
        self._learn_from_unverified(context)
        verify = self.costs.verify
        if self.by_calibration_alone and isinstance(verify, ServedPassCosts):
            verify = verify.calibrated
        # name -> (expected tokens per target step, draft tokens, expected tokens of the cycle)
        options = {"none": (1.0 / verify(1), 0, 1.0)}
        proposal = self.lookup.propose(context, k, sampling, generator) if k > 0 else Proposal.empty()
        lookup_estimate = self._lookup_estimate()
        looked_up = None if not proposal.tokens.shape[1] else (context.shape[1], lookup_estimate,
                                                                  int(proposal.tokens[0, 0]))
        if proposal.tokens.shape[1]:
            # a prefix of the lookup's guess may be worth more than all of it: each token beyond costs verify time
            a = self.acceptance[lookup_estimate].rate
            n = best_k(a, 0.0, verify, proposal.tokens.shape[1])
            options["lookup"] = (expected_tokens(a, n) / verify(n + 1), n, expected_tokens(a, n))
            proposal = proposal.prefix(n)
        catch_up = missed = behind = 0.0
        if self.model_drafter is not None and k > 0:
            a, c = self.acceptance["model"].rate, self.costs.draft_step
            k_model = best_k(a, c, verify, k)
            tokens, cycle = expected_tokens(a, k_model), k_model * c + verify(k_model + 1)  # cycle: once caught up
            # Tokens the model must first take in beyond the one its first step feeds (the whole prompt the first
            # time it drafts in a request), as far as the regret has not paid for them.
            behind = 0 if self.reading else max(0, self.model_drafter.tokens_behind(context) - 1)
            catch_up = behind * (self.costs.draft_token if self.costs.draft_token is not None else c)
            missed = max(0.0, 1.0 / max(rate for rate, _, _ in options.values()) - cycle / tokens)  # per token
            options["model"] = (tokens / (cycle + max(0.0, catch_up - self.regret)), k_model, tokens)
        choice = best(options, self.min_gain)
        if self.reading or (choice == "model" and behind):
            # Catching up takes a pass of the model per cycle, beside this cycle's option (whichever wins it, once
            # begun), where other requests decode beside this one: they wait for one pass at a time, never for the
            # whole prompt
            if not self.reading:
                self.regret, catch_up = max(0.0, self.regret - catch_up), 0.0
            self.reading = not self.model_drafter.read_ahead(context, whole=not self.others_waiting)
            if self.reading and choice == "model":
                del options["model"]
                choice = best(options, self.min_gain)
        self.chosen = None if choice == "none" else choice
        self.estimate = lookup_estimate if choice == "lookup" else self.chosen
        self.unverified = looked_up if choice == "none" else None
        if choice == "model":
            self.regret = max(0.0, self.regret - catch_up)
            proposal = self.model_drafter.propose(context, options["model"][1], sampling, generator)
        else:
            # what a caught-up model would have saved on this cycle's tokens, counted toward catching it up
            self.regret += missed * options[choice][2]
            if choice == "none":
                proposal = Proposal.empty(context.shape[0])
        if self.estimate is not None:
            proposal.acceptance = self.acceptance[self.estimate].rate
        proposal.source = {"lookup": self.lookup.name, "model": self.model_drafter.name if self.model_drafter else
                           None, "none": "none"}[choice]
        return proposal

    def fork(self, pools=None, shared_history=True) -> ChoosingDrafter:
        """A fork shares the costs that served passes teach (ServedPassCosts)."""
        model = self.model_drafter.fork(pools, shared_history) if self.model_drafter is not None else None
        acceptance, weight, decay = self.prior
        return ChoosingDrafter(self.lookup.fork(pools, shared_history), model, self.costs, acceptance, weight, decay,
                               self.min_gain)

    def observe_pass(self, width: int, seconds: float) -> None:
        if isinstance(self.costs.verify, ServedPassCosts):
            self.costs.verify.observe(width, seconds)

    def close(self) -> None:
        self.lookup.close()
        if self.model_drafter is not None:
            self.model_drafter.close()

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        if self.chosen is None:
            return
        self.acceptance[self.estimate].observe(n_drafted, n_accepted)
        (self.lookup if self.chosen == "lookup" else self.model_drafter).accept(n_drafted, n_accepted)

    def _learn_from_unverified(self, context) -> None:
        """The last cycle's lookup that was not verified: was its first token what the target produced there?"""
        if self.unverified is not None:
            length, estimate, token = self.unverified
            if context.shape[1] > length:
                self.acceptance[estimate].observe(1, int(context[0, length]) == token)
            self.unverified = None

    def _lookup_estimate(self) -> str | tuple[str, int, bool]:
        """Which acceptance estimate the lookup's latest proposal is judged by: its band of matched suffix lengths and
        whether the matched occurrences agreed on its first token, where the lookup says how long a suffix it matched
        (MATCH_BANDS); else the one estimate for all lookups."""
        matched = self.lookup.last_match
        if not matched:
            return "lookup"
        return "lookup", max(band for band in MATCH_BANDS if band <= matched), self.lookup.last_agreement >= 1.0
