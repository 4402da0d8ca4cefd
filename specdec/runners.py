"""Runners: one sequence's view of a model — forward over new tokens with a KV cache, and roll back.

The engine and the drafters talk to models only through this interface, so another runtime (llama.cpp, an early-exit
view of the target) plugs in without touching the decoding loop.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class Runner(Protocol):
    vocab_size: int  # logits are cut to this many tokens (the vocabulary shared by target and drafter)
    max_length: int  # the model's context length

    @property
    def length(self) -> int:
        """Number of tokens held in the cache."""

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append input_ids [batch, n] to the cache -> logits [batch, n or 1, vocab_size] (float32)."""

    def rollback(self, length: int) -> None:
        """Drop cache entries past `length` tokens."""

    def verify_width(self, length: int) -> int | None:
        """Optional: the widest pass whose logits equal one-token passes bit for bit after `length` cached tokens
        (runtimes whose kernels depend on the pass width or the context length); the engine never verifies more
        tokens at once. None, or no such method: no limit."""


class RollbackUnsupported(ValueError):
    """The model's cache cannot be trimmed, so rejected draft tokens could not be undone."""


def context_length(config) -> int:
    text_config = config.get_text_config(decoder=True)
    return int(getattr(text_config, "max_position_embeddings", None) or 2**31)


def check_rollback_supported(model) -> None:
    """Refuse up front a model whose KV cache cannot be cut back to an arbitrary length.

    Sliding-window and linear-attention layers drop or fold past states; rolling them back needs states they no
    longer hold, so speculation over them would silently corrupt the context. For transformers models (the torch
    runtime's check_rollback); llama.cpp checks the models it loads.
    """
    cache = DynamicCache(config=model.config)
    unsupported = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if unsupported:
        raise RollbackUnsupported(
            f"{type(model).__name__} uses cache layers that cannot be rolled back ({', '.join(unsupported)}); "
            "speculative decoding needs a model with full attention in every layer.")


def has_dynamic_quantization(model) -> bool:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return any(isinstance(module, DynamicQuantizedLinear) for module in model.modules())


def new_runner(model, vocab_size: int) -> Runner:
    """A fresh sequence (empty cache) on a loaded model of any runtime."""
    make = getattr(model, "new_runner", None)  # runtimes other than torch build their own runners
    return make(vocab_size) if make is not None else TorchRunner(model, vocab_size)


class TorchRunner:
    """A transformers causal LM (shared, never copied) plus this sequence's own DynamicCache."""

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.max_length = context_length(model.config)
        self.cache = DynamicCache(config=model.config)
        # torch's dynamically quantized layers scale a pass's activations by the largest of all its tokens, so a
        # token's logits depend on the tokens verified beside it (measured: up to 0.06 apart on one layer; greedy
        # output of such an int8 target diverged on a summary prompt). Only one-token passes reproduce plain decoding
        # on such a model. specdec's own int8 (models.quantize_int8) keeps rows independent and is not limited.
        self._widest = 1 if has_dynamic_quantization(model) else None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        # logits_to_keep=1 skips the LM head (vocab x hidden per row) for positions nobody reads.
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        return out.logits[..., : self.vocab_size].float()

    def verify_width(self, length: int) -> int | None:
        return self._widest

    def rollback(self, length: int) -> None:
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)
