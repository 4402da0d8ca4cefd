"""Choosing k, the number of draft tokens per cycle: fixed, or adapted per request from what has been observed."""

from __future__ import annotations


class FixedK:
    """The same k every cycle."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"k (draft tokens per cycle) must be >= 1, got {k}")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None:
        """A cycle drafted n_drafted tokens in draft_s seconds and the target accepted n_accepted in verify_s."""


def make_k_policy(k: int | str):
    """An int -> FixedK; "auto" -> a fresh AdaptiveK (one per request: its estimates are the request's own)."""
    if k == "auto":
        return AdaptiveK()
    if isinstance(k, str):
        if not k.isdigit():
            raise ValueError(f"k must be a positive integer or 'auto', got {k!r}")
        k = int(k)
    return FixedK(k)
