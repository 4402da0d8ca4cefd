"""Choosing k, the number of draft tokens per cycle: fixed, or adapted per request from what has been observed."""

from __future__ import annotations

from typing import Callable

from specdec_exact.metrics import tested_tokens


class FixedK:
    """The same k every cycle."""

    acceptance = None  # it keeps no estimate

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"k (draft tokens per cycle) must be >= 1, got {k}")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None:
        """A cycle drafted n_drafted tokens in draft_s seconds and the target accepted n_accepted in verify_s."""


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a cycle of k draft tokens emits on average, the recovered or bonus token included, when each draft token
    is accepted with probability `acceptance` independently (Leviathan et al. 2023, eq. 1): (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_k(acceptance: float, draft_cost: float, verify_cost: Callable[[int], float], k_max: int,
           k_min: int = 1) -> int:
    """The k in k_min..k_max with the most expected tokens per second: E(k) / (k * draft_cost + verify_cost(k + 1)).

    k = 0 is plain decoding (E = 1 token per verify_cost(1)): the best choice when drafting costs more than it saves.

    draft_cost: seconds per draft token; verify_cost(width): seconds for a target pass over `width` tokens. With a
    verify cost that does not grow with width this is Leviathan et al.'s speed-up (1 - a^(k+1)) / ((1 - a)(k c + 1)),
    c = draft_cost / verify_cost. Ties go to the smaller k.
    """
    def rate(k: int) -> float:
        return expected_tokens(acceptance, k) / (k * draft_cost + verify_cost(k + 1))
    return max(range(k_min, k_max + 1), key=rate)


class Acceptance:
    """A drafter's acceptance rate: exponentially weighted accepted / tested draft tokens, with a prior worth
    `weight` trials."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.successes = self.trials = 0.0

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        self.successes = self.decay * self.successes + n_accepted
        self.trials = self.decay * self.trials + tested_tokens(n_drafted, n_accepted)

    @property
    def rate(self) -> float:
        return (self.successes + self.weight * self.prior) / (self.trials + self.weight)


class _VerifyCost:
    """Seconds of one target pass as a line in its width w (draft tokens + 1): t(w) = t(1) + slope (w - 1).

    An exponentially weighted least-squares fit. While the observed widths barely vary (a steady k) they say nothing
    about the slope, so it is shrunk toward a prior relative slope: t(w) = t(1) (1 + prior_slope (w - 1)).
    """

    def __init__(self, decay: float, prior_slope: float, prior_weight: float = 4.0):
        self.decay, self.prior_slope, self.prior_weight = decay, prior_slope, prior_weight
        self.n = self.x = self.t = self.xx = self.xt = 0.0  # decayed sums of 1, x = w - 1, t, x^2, x t

    def observe(self, width: int, seconds: float) -> None:
        x, d = width - 1, self.decay
        self.n, self.x, self.t = d * self.n + 1, d * self.x + x, d * self.t + seconds
        self.xx, self.xt = d * self.xx + x * x, d * self.xt + x * seconds

    @property
    def observed(self) -> bool:
        return self.n > 0

    def __call__(self, width: int) -> float:
        """Predicted seconds at this width; in units of one width-1 pass until something was observed."""
        if not self.observed:
            return 1.0 + self.prior_slope * (width - 1)
        mean_x, mean_t = self.x / self.n, self.t / self.n
        spread = self.xx - self.n * mean_x ** 2  # weighted sum of squared deviations of x
        covariance = self.xt - self.n * mean_x * mean_t
        prior = self.prior_slope * mean_t / (1.0 + self.prior_slope * mean_x)  # prior_slope * t(1), from the mean
        # Posterior mean of the slope under a normal prior worth prior_weight units of squared width spread.
        slope = max(0.0, (covariance + self.prior_weight * prior) / (spread + self.prior_weight))
        base = max(mean_t - slope * mean_x, 1e-3 * mean_t)  # a cost is positive whatever the noise says
        return base + slope * (width - 1)


K_MAX = 8  # the most draft tokens a cycle proposes under k="auto"


class AdaptiveK:
    """Chooses k each cycle to maximise expected tokens per second from this request's own observations.

    Acceptance a: exponentially weighted successes / trials, where a cycle's trials are its accepted draft tokens
    plus the first rejected one (the tokens after it were never tested), plus a prior worth `prior_weight` trials.
    Costs: seconds per draft token, and verify seconds as a function of width (_VerifyCost). A drafter with no model
    (prompt lookup) costs ~0 per token, so only the acceptance and the verify width limit its k.

    When no k pays (a verify pass over two tokens costs more than the tokens it is expected to yield, as on a small
    CPU) it chooses k = 0, plain decoding, but drafts one token now and then to see whether that has changed: after
    `probe_every` plain cycles, an interval that doubles (up to 8x) while the probes keep saying k = 0.
    """

    def __init__(self, k_max: int = K_MAX,
                 prior_acceptance: float = 0.6,  # cautious: Leviathan et al. 2023 measure 0.5-0.9 for same-family pairs
                 prior_weight: float = 2.0,  # worth 2 trials: the first few cycles overrule it
                 prior_draft_cost: float = 0.1,  # seconds per draft token / seconds per target step, until measured
                 # Extra verify time per extra token, relative to a width-1 pass, until widths vary enough to fit it:
                 # small where a pass is memory-bound (GPU). Far from it on 2 CPU cores, fp32: the 1.5B target took
                 # 0.40 s at width 1, 0.80 s at 2, 1.0-1.2 s at 3-9 (measured), which the fit then learns.
                 prior_verify_slope: float = 0.05,
                 decay: float = 0.9,  # per cycle: estimates follow the last ~10 cycles, as content shifts a
                 probe_every: int = 8,
                 # Learn costs from the clock. False: keep the prior costs (calibrated when the models loaded), so
                 # that every choice depends only on the tokens and a seeded sample repeats exactly; wall-clock times
                 # differ from run to run, and k decides how the random stream is consumed.
                 timed: bool = True):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 <= prior_acceptance <= 1.0 or prior_weight <= 0:
            raise ValueError("prior_acceptance must be in [0, 1] and prior_weight > 0")
        if prior_draft_cost < 0 or prior_verify_slope < 0 or not 0.0 < decay <= 1.0:
            raise ValueError("prior costs must be >= 0 and decay in (0, 1]")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.probe_every = self.probe_interval = probe_every
        self.plain_cycles = 0  # consecutive cycles with k = 0
        self.speculative_cycles = 0
        self.k_max, self.decay, self.timed = k_max, decay, timed
        self.prior_draft_cost = prior_draft_cost
        self.accepted = Acceptance(prior_acceptance, prior_weight, decay)
        self.draft_s = self.drafted = 0.0  # decayed draft seconds / drafted tokens
        self.cycles = 0
        self.verify_cost = _VerifyCost(decay, prior_verify_slope)

    @property
    def acceptance(self) -> float:
        return self.accepted.rate

    @property
    def draft_cost(self) -> float:
        """Seconds per draft token (relative units while nothing was timed, like verify_cost)."""
        if self.drafted > 0:
            return self.draft_s / self.drafted
        return self.prior_draft_cost * self.verify_cost(1)

    def next_k(self) -> int:
        k = best_k(self.acceptance, self.draft_cost, self.verify_cost, self.k_max, k_min=0)
        if k > 0:
            self.plain_cycles, self.probe_interval = 0, self.probe_every
            self.speculative_cycles += 1
            if self.speculative_cycles % (2 * self.probe_every) == 0:
                return 0  # a plain pass now and then: widths that vary let the fit learn what width costs
            return k
        if best_k(1.0, self.draft_cost, self.verify_cost, self.k_max, k_min=0) == 0:
            return 0  # not even a drafter that is always right would pay at these costs: nothing to probe for
        self.plain_cycles += 1
        if self.plain_cycles <= self.probe_interval:
            return 0
        self.plain_cycles = 0
        self.probe_interval = min(2 * self.probe_interval, 8 * self.probe_every)
        return 1

    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None:
        """A cycle drafted n_drafted tokens in draft_s seconds and the target accepted n_accepted in verify_s."""
        d = self.decay
        self.cycles += 1
        if n_drafted > 0:
            self.accepted.observe(n_drafted, n_accepted)
        if not self.timed:
            return
        # The first cycle's draft time includes the drafter's prefill of the whole prompt: not a per-token cost.
        if self.cycles > 1:
            self.draft_s, self.drafted = d * self.draft_s + draft_s, d * self.drafted + n_drafted
        self.verify_cost.observe(n_drafted + 1, verify_s)


def make_k_policy(k: int | str, **options):
    """An int -> FixedK; "auto" -> a fresh AdaptiveK (one per request: its estimates are the request's own), with
    options (AdaptiveK's arguments, e.g. prior costs measured when the models loaded)."""
    if k == "auto":
        return AdaptiveK(**options)
    if isinstance(k, str):
        if not k.isdigit():
            raise ValueError(f"k must be a positive integer or 'auto', got {k!r}")
        k = int(k)
    return FixedK(k)
