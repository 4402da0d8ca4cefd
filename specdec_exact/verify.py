"""Verification of draft tokens against the target: where exactness lives.

Glossary (used throughout specdec): the target's distribution is p, the drafter's is q, the drafter proposes k tokens.
Verification accepts a prefix of the draft; at the first rejection it emits a *recovered* token, and when all k are
accepted it emits a *bonus* token from the target's k+1-th position. Either way each target call emits
n_accepted + 1 tokens.

Both functions are pure: no models, no caches. They keep a batch dimension; rows are independent.
"""

from __future__ import annotations

import torch

from specdec_exact.sampling import argmax, sample


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept draft tokens while they equal the target's argmax; then emit the target's argmax.

    draft_tokens [batch, k], target_logits [batch, k+1, vocab]
    -> tokens [batch, k+1] (row b is valid up to n_accepted[b] + 1), n_accepted [batch]
    """
    k = draft_tokens.shape[1]
    target_choice = argmax(target_logits)  # [batch, k+1]
    matches = draft_tokens == target_choice[:, :k]  # [batch, k]
    n_accepted = matches.int().cumprod(dim=-1).sum(dim=-1)  # [batch]
    # Accepted draft tokens equal the target's choice, so the target's row is the emitted sequence.
    return target_choice, n_accepted


def acceptance_probs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for each draft token x -> [batch, k]. draft_probs None means one-hot q (q(x) = 1)."""
    k = draft_tokens.shape[1]
    p_x = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    if draft_probs is None:
        return p_x.clamp(max=1.0)
    q_x = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    return torch.where(q_x > 0, (p_x / q_x.clamp(min=1e-30)).clamp(max=1.0), 1.0)


def residual_probs(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension: the distribution of the recovered token.

    With q = 0 (no draft at this position) this is p itself, which is how the bonus token is drawn.
    """
    residual = (target_row - draft_row).clamp(min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    # total is 0 only when p == q up to rounding; a rejection is then (almost) impossible and p is the right answer.
    return torch.where(total > 0, residual / total.clamp(min=1e-30), target_row)


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): output is distributed exactly as p.

    draft_tokens [batch, k]; draft_probs q [batch, k, vocab], or None for a deterministic drafter (one-hot q);
    target_probs p [batch, k+1, vocab], already warped by the same temperature / top-k / top-p as q.
    -> tokens [batch, k+1] (row b is valid up to n_accepted[b] + 1), n_accepted [batch]
    """
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    accept_prob = acceptance_probs(draft_tokens, draft_probs, target_probs)  # [batch, k]
    uniform = torch.rand(batch, k, generator=generator)
    accepted = uniform < accept_prob
    n_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1)  # [batch]

    # The token after the accepted prefix: recovered from the residual at a rejection, bonus from p_{k+1} otherwise.
    rows = torch.arange(batch)
    target_row = target_probs[rows, n_accepted]  # [batch, vocab]
    draft_row = torch.zeros(batch, vocab, dtype=target_probs.dtype)
    rejected = n_accepted < k
    if rejected.any():
        at = n_accepted[rejected]
        if draft_probs is None:
            draft_row[rejected] = torch.nn.functional.one_hot(draft_tokens[rejected, at], vocab).to(draft_row.dtype)
        else:
            draft_row[rejected] = draft_probs[rejected, at].to(draft_row.dtype)
    last = sample(residual_probs(target_row, draft_row), generator)  # [batch]

    tokens = torch.cat([draft_tokens, torch.zeros(batch, 1, dtype=draft_tokens.dtype)], dim=1)  # [batch, k+1]
    tokens[rows, n_accepted] = last
    return tokens, n_accepted
