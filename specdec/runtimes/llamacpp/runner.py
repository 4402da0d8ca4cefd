"""One sequence in a slot of a llama.cpp SlotPool: forward over new tokens (logits of each, or the last), roll back."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.runtimes.llamacpp.context import BATCH, Context, evaluate

if TYPE_CHECKING:
    from specdec.runtimes.llamacpp.context import SlotPool

# A new sequence's first pass of at least this many tokens (a prompt) runs in the model's prefill layout where that
# differs (LlamaCppModel.prefill_model); shorter ones stay where they are.
PREFILL_MIN_TOKENS = 32


class LlamaCppRunner:
    """Sequence `seq` of a pool's context. Made by SlotPool.take; close() gives the slot back (so does collection)."""

    def __init__(self, pool: SlotPool, seq: int, vocab_size: int):
        self.pool, self.model, self.seq, self.vocab_size = pool, pool.model, seq, vocab_size
        self.max_length = pool.max_length
        self._length = 0
        self._refusal: str | None = None  # why this runner may no longer run (its slot was taken over or closed)
        self._release = weakref.finalize(self, pool.give, seq)

    def close(self) -> None:
        """Give the slot back (safe to call more than once)."""
        if self._refusal is None:
            self._refusal = "this runner was closed; start a new one"
        self._release()

    def evict(self, why: str) -> None:
        """The pool takes the slot back from under this runner: it refuses to run from now on, saying why."""
        self._refusal = why
        self._release()

    def verify_width(self, length: int) -> int:
        return self.model.verify_width(length)

    @property
    def length(self) -> int:
        return self._length

    def check_room(self, needed: int) -> Context:
        """This runner's context, ready for a sequence of `needed` tokens."""
        if self._refusal is not None:
            raise RuntimeError(self._refusal)
        return self.pool.context_for(needed)

    def advance(self, n: int) -> None:
        """n more tokens of this sequence were evaluated (by the pool's fused pass)."""
        self._length += n

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError("the llama.cpp runtime runs one sequence at a time (batch size 1)")
        tokens = input_ids[0].tolist()
        if not tokens:
            raise ValueError("forward needs at least one token")
        wanted = [not last_only or i == len(tokens) - 1 for i in range(len(tokens))]
        elsewhere = self.model.prefill_model
        context = self.check_room(self._length + len(tokens))
        if elsewhere is not None and self._length == 0 and len(tokens) >= PREFILL_MIN_TOKENS:
            rows, state = elsewhere.prefill(tokens, wanted, context.n_seq, self.seq)
            context.load_state(state, self.seq)
            self._length = len(tokens)
        else:
            rows = []
            for start in range(0, len(tokens), BATCH):  # in passes of at most BATCH tokens
                piece = tokens[start:start + BATCH]
                rows += evaluate(self.model, context, [(self.seq, self._length + i, token, want) for i, (token, want)
                                                       in enumerate(zip(piece, wanted[start:start + BATCH]))])
                self._length += len(piece)
        logits = torch.from_numpy(np.stack(rows))[None]  # [1, rows, n_vocab]
        return logits[..., : self.vocab_size]

    def rollback(self, length: int) -> None:
        if length < self._length:
            self.check_room(length).remove(self.seq, length)
            self._length = length
