"""Hybrid drafting: prompt lookup when the context repeats itself, a draft model otherwise.

A lookup hit costs no model pass and, where text repeats, is often accepted in full; elsewhere the draft model does
better than nothing. The draft model needs no notice of the cycles it sat out: ModelDrafter syncs its cache to the
context by common prefix at every proposal, feeding the tokens committed meanwhile in one pass.
"""

from __future__ import annotations

from specdec_exact.drafters import TargetInfo, model_drafter, register
from specdec_exact.drafters.base import Drafter, Proposal
from specdec_exact.drafters.ngram import NgramDrafter
from specdec_exact.registry import DEFAULT_DRAFT


class HybridDrafter(Drafter):
    """Asks `lookup` first and falls back to `fallback` when it proposes nothing."""

    name = "hybrid"

    def __init__(self, lookup: Drafter, fallback: Drafter):
        self.lookup = lookup
        self.fallback = fallback
        self.last: Drafter | None = None  # the drafter whose proposal the target is verifying

    def fork(self, pools=None, shared_history=True) -> HybridDrafter:
        return HybridDrafter(self.lookup.fork(pools, shared_history), self.fallback.fork(pools, shared_history))

    def close(self) -> None:
        self.lookup.close()
        self.fallback.close()

    def begin(self, prompt_ids) -> None:
        self.lookup.begin(prompt_ids)
        self.fallback.begin(prompt_ids)
        self.last = None

    def propose(self, context, k, sampling, generator) -> Proposal:
        proposal = self.lookup.propose(context, k, sampling, generator)
        self.last = self.lookup
        if proposal.tokens.shape[1] == 0 and k > 0:
            proposal = self.fallback.propose(context, k, sampling, generator)
            self.last = self.fallback
        return proposal

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        if self.last is not None:
            self.last.accept(n_drafted, n_accepted)


@register("hybrid")
def _hybrid(target: TargetInfo, arg: str | None):
    """`hybrid` (prompt lookup, else the default draft model) or `hybrid:DRAFT` (a draft model given like --draft)."""
    draft_model, draft_tokenizer = target.load_draft(arg or DEFAULT_DRAFT)
    return HybridDrafter(NgramDrafter(), model_drafter(draft_model, target, draft_tokenizer)), draft_model
