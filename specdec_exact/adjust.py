"""What a request does to the target's logits before it samples: a bias per token (OpenAI's logit_bias) and the
presence and frequency penalties on the tokens generated so far.

Under speculation a verify pass gives rows for several positions at once, and the penalties at a draft position
depend on the draft tokens before it: row j of a pass is adjusted for the tokens generated before the pass and the
first j tokens the pass was fed after the newest one, so that every row is the distribution that decoding one token
at a time would sample from there (its logits being bit for bit those of a one-token pass). Greedy output is then
the argmax of the adjusted rows, and a sample's acceptance compares against them, exactly as target-only decoding
with the same adjustments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_BIAS = 100.0  # OpenAI's bounds for a token's bias: -100 bans it, 100 all but forces it
MAX_PENALTY = 2.0  # OpenAI's bounds for the presence and frequency penalties


@dataclass(frozen=True)
class LogitAdjust:
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence: float = 0.0  # subtracted from the logit of every token generated at least once
    frequency: float = 0.0  # subtracted once for every time the token was generated

    def __post_init__(self):
        for token, bias in self.bias:
            if token < 0 or not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                 f"got {token}: {bias:g}")
        for name in ("presence", "frequency"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"the {name} penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                                 f"{getattr(self, name):g}")

    @property
    def penalises(self) -> bool:
        return bool(self.presence or self.frequency)

    def check_vocab(self, size: int) -> None:
        beyond = [token for token, _ in self.bias if token >= size]
        if beyond:
            raise ValueError(f"logit_bias names token id(s) {beyond} beyond the vocabulary (ids 0 to {size - 1})")

    def rows(self, logits: torch.Tensor, generated: list[int], fed: list[int]) -> torch.Tensor:
        """logits [n, vocab]: the rows of n consecutive positions, row 0 right after the `generated` tokens and row
        j after the first j tokens of `fed` too -> the adjusted rows (float32; the input is left alone)."""
        out = logits.float().clone()
        if self.bias:
            tokens, biases = zip(*self.bias)
            out[:, list(tokens)] += torch.tensor(biases, dtype=out.dtype)
        if self.penalises:
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=out.shape[1])[:out.shape[1]]
            counts = counts.to(out.dtype)
            for j in range(out.shape[0]):
                if j:
                    counts[fed[j - 1]] += 1
                out[j] -= self.frequency * counts + self.presence * (counts > 0).to(out.dtype)
        return out
