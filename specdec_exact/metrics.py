"""Speculation statistics of one generation. Derived figures are defined here and nowhere else."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def tested_tokens(n_drafted: int, n_accepted: int) -> int:
    """Draft tokens a cycle tested: its accepted ones and the first rejected one (those after it were never checked)."""
    return n_accepted + (n_accepted < n_drafted)


@dataclass
class SpecStats:
    target_calls: int = 0  # target forward passes, prefill included
    draft_calls: int = 0  # drafter model forward passes (0 for model-free drafters)
    cycles: int = 0  # verify passes: draft -> one target call -> accept/reject
    # Cycles that could verify only one token because no wider pass reproduces one-token passes bit for bit at that
    # context length on this runtime (llama.cpp's kernels, torch's dynamic int8): plain decoding, by necessity.
    narrowed_cycles: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    new_tokens: int = 0  # tokens returned to the user (after EOS / max_new_tokens / stop truncation)
    cached_prompt_tokens: int = 0  # prompt tokens the target took from the prompt cache instead of prefilling them
    emitted_per_cycle: Counter = field(default_factory=Counter)  # histogram: tokens emitted by a cycle -> count
    drafted_by_position: list[int] = field(default_factory=list)  # [i]: cycles that drafted a token at position i
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: cycles whose draft token i was accepted
    # drafter name -> [cycles, drafted tokens, accepted tokens]: who drafted, where a drafter delegates per cycle
    by_drafter: dict[str, list[int]] = field(default_factory=dict)
    # Counts specific to a drafter, summed over its proposals (a cross-vocabulary draft: its tokens written, the
    # target tokens they re-tokenize to, ...; see the drafter's module)
    drafter_counts: Counter = field(default_factory=Counter)
    prefill_s: float = 0.0
    prompt_cache_s: float = 0.0  # of prefill_s: the prompt cache's bookkeeping (lookup, joining, cutting, storing)
    draft_s: float = 0.0
    verify_s: float = 0.0
    grammar_s: float = 0.0  # a grammar's masks (specdec_exact.grammar), outside draft_s and verify_s
    total_s: float = 0.0

    def observe(self, n_drafted: int, n_accepted: int, drafter: str = "drafter") -> None:
        """Record one verify cycle in which `drafter` drafted n_drafted tokens, the first n_accepted accepted."""
        counts = self.by_drafter.setdefault(drafter, [0, 0, 0])
        counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + n_drafted, counts[2] + n_accepted
        self.cycles += 1
        self.drafted_tokens += n_drafted
        self.accepted_tokens += n_accepted
        self.emitted_per_cycle[n_accepted + 1] += 1
        missing = n_drafted - len(self.drafted_by_position)
        if missing > 0:
            self.drafted_by_position += [0] * missing
            self.accepted_by_position += [0] * missing
        for i in range(n_drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < n_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify cycle: accepted draft tokens plus the recovered or bonus token (so >= 1)."""
        return (self.accepted_tokens + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def to_dict(self) -> dict:
        return {
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "cycles": self.cycles,
            "narrowed_cycles": self.narrowed_cycles,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "new_tokens": self.new_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_s": self.tokens_per_s,
            "emitted_per_cycle": {str(n): c for n, c in sorted(self.emitted_per_cycle.items())},
            "acceptance_by_position": self.acceptance_by_position,
            "by_drafter": {name: {"cycles": c, "drafted_tokens": d, "accepted_tokens": a}
                           for name, (c, d, a) in self.by_drafter.items()},
            "drafter_counts": dict(self.drafter_counts),
            "time_s": {
                "prefill": self.prefill_s,
                "prompt_cache": self.prompt_cache_s,
                "draft": self.draft_s,
                "verify": self.verify_s,
                "grammar": self.grammar_s,
                "other": max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s - self.grammar_s),
                "total": self.total_s,
            },
        }


def per_token_acceptance(stats: SpecStats) -> float | None:
    """a of the i.i.d. model: accepted draft tokens / tested ones (tested_tokens), None if nothing was drafted.

    accepted / drafted (SpecStats.acceptance_rate) underestimates a for k > 1. Tested tokens at position i > 0 are
    the cycles that accepted position i-1 and drafted position i: exact when every cycle drafts the same k (the
    last cycle of a generation may draft fewer, which counts at most one extra test per generation).
    """
    drafted, accepted = stats.drafted_by_position, stats.accepted_by_position
    if not drafted or drafted[0] == 0:
        return None
    tested = drafted[0] + sum(min(accepted[i - 1], drafted[i]) for i in range(1, len(drafted)))
    return sum(accepted) / tested
