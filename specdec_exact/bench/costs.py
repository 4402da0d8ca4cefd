"""Measured costs (draft step, target verify pass by width) and the speed-up they predict (Leviathan et al. 2023).

Prediction for a draft model with k draft tokens per cycle, per-token acceptance a, cost ratio c and verify curve V:

    expected tokens per cycle  E = (1 - a^(k+1)) / (1 - a)                       (Leviathan et al. 2023, eq. 1)
    predicted speed-up         S = E / (k c + V(k+1) / V(1))

c = one draft step / one target step (both over one new token after a warm cache); V(w) = seconds of one target
pass over w new tokens. Leviathan et al.'s theorem 3.8, E / (k c + 1), assumes a pass over k+1 tokens costs what a
pass over one does; on a CPU it does not, so the measured V(k+1) / V(1) replaces the 1.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec_exact.adaptive import expected_tokens
from specdec_exact.vocabulary import model_vocab_size
from specdec_exact.runtimes import Runner, runtime_of

VERIFY_WIDTHS = (1, 2, 4, 8, 16)  # new tokens per target pass on the verify-cost curve
WARM_CONTEXT = 200  # tokens in the cache before each timed pass: a typical prompt, not an empty cache


def predicted_speedup(acceptance: float, k: int, c: float, verify_ratio: float) -> float:
    """E / (k c + V(k+1)/V(1)); see the module docstring."""
    if not 0.0 <= acceptance <= 1.0 or k < 1 or c < 0 or verify_ratio <= 0:
        raise ValueError(f"need 0 <= a <= 1, k >= 1, c >= 0, V ratio > 0; got a={acceptance}, k={k}, c={c}, "
                         f"V ratio={verify_ratio}")
    return expected_tokens(acceptance, k) / (k * c + verify_ratio)


def _private_sequence(model, vocab_size: int) -> Runner:
    """A sequence of the model's own pool of one (a benchmark runs nothing beside it)."""
    return runtime_of(model).pool(model).take(vocab_size)


def _pass_s(runner: Runner, new_ids: torch.Tensor, last_only: bool) -> float:
    """Seconds of one forward over new_ids [1, w] on the warm cache, which is then rolled back to where it was."""
    length = runner.length
    started = time.perf_counter()
    try:
        runner.forward(new_ids, last_only=last_only)
    finally:
        runner.rollback(length)
    return time.perf_counter() - started


def measure_costs(target, draft, vocab_size: int, context: torch.Tensor, widths=VERIFY_WIDTHS,
                  reps: int = 5, other_drafts: dict | None = None) -> dict:
    """Time target passes over each width and one draft step (draft may be None), each after the same warm cache of
    context [1, n] tokens. Reps go round the widths in turn, so machine drift spreads over all of them.
    other_drafts {name: model}: more draft models (a bench's model:NAME methods), timed in the same rounds; their c
    lands in "c_by_draft"."""
    widths = sorted(set(widths) | {1})
    new_ids = context[:, : max(widths)].flip(1)  # [1, max width]: any in-vocabulary tokens will do
    target_runner = _private_sequence(target, vocab_size)
    target_runner.forward(context, last_only=True)
    drafts = {name: model for name, model in {"draft": draft, **(other_drafts or {})}.items() if model is not None}
    draft_runners = {}
    for name, model in drafts.items():
        own = model_vocab_size(model)  # a draft with its own vocabulary reads ids below its size: any will do
        draft_runners[name] = (_private_sequence(model, min(vocab_size, own)), new_ids[:, :1] % own)
        draft_runners[name][0].forward(context % own, last_only=True)
    target_s = {w: [] for w in widths}
    draft_s = {name: [] for name in drafts}
    for _ in range(reps):
        for w in widths:
            # The engine's verify pass reads logits at every position: last_only=False, as there.
            target_s[w].append(_pass_s(target_runner, new_ids[:, :w], last_only=False))
        for name, (runner, token) in draft_runners.items():
            # A draft step feeds one token and reads the last logits, as ModelDrafter does.
            draft_s[name].append(_pass_s(runner, token, last_only=True))
    target_median = {w: statistics.median(samples) for w, samples in target_s.items()}
    mine = draft_s.get("draft", [])
    costs = {
        "context_tokens": int(context.shape[1]),
        "reps": reps,
        "target_pass_s": {str(w): samples for w, samples in target_s.items()},
        "target_pass_median_s": {str(w): s for w, s in target_median.items()},
        "verify_ratio": {str(w): s / target_median[1] for w, s in target_median.items()},
        "draft_step_s": mine,
        "draft_step_median_s": statistics.median(mine) if mine else None,
        "c_by_draft": {name: statistics.median(samples) / target_median[1] for name, samples in draft_s.items()
                       if name != "draft"},
    }
    costs["c"] = costs["draft_step_median_s"] / target_median[1] if mine else None
    return costs
