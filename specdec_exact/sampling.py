"""Logits -> probabilities (temperature, top-k, top-p) and seeded sampling.

The same `SamplingConfig` is applied to the target's logits (p) and the drafter's logits (q) before verification:
speculative sampling is exact only for the distribution that both sides were warped to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy (argmax); > 0 samples from softmax(logits / temperature)
    top_k: int | None = None  # keep only the k most likely tokens; None keeps all
    top_p: float | None = None  # keep the smallest set of tokens whose mass reaches top_p; None keeps all

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): the same indices (the first of equal maxima; a NaN counts as the maximum), through numpy
    for CPU tensors of float types it holds. torch's reduction over a vocabulary-sized row takes 0.15-0.3 ms on a
    2-core machine (more with its thread pool busy), numpy's ~0.01 ms, and greedy decoding takes one per draft token
    and per verified row (tests/test_sampling.py checks the two agree)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16, torch.float64) \
            and logits.dim() > 0 and logits.shape[-1] > 0:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1), dtype=np.int64))
    return logits.argmax(dim=-1)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Warp logits [..., vocab] into a probability distribution [..., vocab] for sampling (temperature > 0)."""
    if config.greedy:
        raise ValueError("greedy decoding uses argmax of the logits, not probabilities")
    logits = logits.float()
    # Shifted so that the largest is 0 before the division, and divided by no less than float32's smallest normal
    # number: a tiny temperature then sends the others to -inf, not the largest to inf or 0/0 (NaN in the softmax)
    temperature = max(config.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p is not None and config.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # A token survives when the tokens ranked above it hold less than top_p, and the most likely one always does
        # (said outright: a top_p below float32's smallest number compares as 0 against the float32 masses)
        drop_sorted = mass_before >= config.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of probs [..., vocab] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from the OS when seed is None (then each call differs)."""
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator
