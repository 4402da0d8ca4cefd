"""Log-probabilities of the committed tokens, from the target's own logits at each of them.

A committed token's row of logits is the one its cycle verified it with, which is bit for bit the row a one-token
pass of plain decoding gives there (the engine verifies no wider than that holds), so the log-probabilities are
those that target-only decoding reports. They are of the model's distribution itself (log-softmax of the logits,
before temperature, top-k or top-p), as OpenAI's and vLLM's are by default, and each row is computed on its own, so
that the same row always gives the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives a position reports (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, and the `top` most likely tokens at its position (most likely first; empty when
    none were asked for). A prompt's first token has none (logprob None): nothing comes before it."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """logits [n >= len(tokens), vocab]: the rows the tokens were committed from (row i gives token i) -> each
    token's TokenLogprob with its `top` most likely alternatives."""
    found = []
    for i, token in enumerate(tokens):
        row = torch.log_softmax(logits[i].float(), dim=-1)
        best = torch.topk(row, top) if top else None
        found.append(TokenLogprob(token, float(row[token]), () if best is None else tuple(
            (int(t), float(v)) for v, t in zip(best.values, best.indices))))
    return tuple(found)


def check_top(top: int | None) -> None:
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs asks for the top {top} tokens at each position: give 0 to {MAX_TOP_LOGPROBS}")
