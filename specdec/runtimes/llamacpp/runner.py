"""One sequence in a slot of a llama.cpp SlotPool: forward over new tokens (logits of each, or the last), roll back."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.runtimes.llamacpp import kv_blocks
from specdec.runtimes.llamacpp.context import BATCH, Context, evaluate, evaluate_prompt, prefill_bounds

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
        self.prompt_tokens_reused = 0  # tokens of its prompt taken from the prompt cache
        self.prompt_cache_s = 0.0  # seconds its prefill spent looking up, joining, cutting and storing blocks
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
        """The widest pass after `length` cached tokens (LlamaCppModel.verify_width). In a pool of several, where its
        passes may be fused with other sequences', one token beyond the longest context the batch calibration
        checked (its slots hold a little more than that: the calibration's passes must fit in them)."""
        if self.pool.sequences > 1 and length > max(self.model.batch_calibration["contexts"]):
            return 1
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
        if self._length == 0:
            rows = self._prefill(tokens, wanted, cacheable=last_only)
        else:
            context = self.check_room(self._length + len(tokens))
            rows = []
            for start in range(0, len(tokens), BATCH):  # in passes of at most BATCH tokens
                piece = tokens[start:start + BATCH]
                rows += evaluate(self.model, context, [(self.seq, self._length + i, token, want) for i, (token, want)
                                                       in enumerate(zip(piece, wanted[start:start + BATCH]))])
                self._length += len(piece)
        logits = torch.from_numpy(np.stack(rows))[None]  # [1, rows, n_vocab]
        return logits[..., : self.vocab_size]

    def _prefill(self, tokens: list[int], wanted: list[bool], cacheable: bool) -> list[np.ndarray]:
        """A new sequence's first tokens (a prompt), in passes along its segments (context.prefill_bounds), in the
        model's prefill layout where it has one; the leading segments come from the prompt cache where it holds them,
        and the prompt's other segments go into it. cacheable: only the last token's logits are wanted (a hit has no
        logits for the tokens it reuses)."""
        context = self.check_room(len(tokens))
        model, n_seq = self.model, context.n_seq
        elsewhere = model.prefill_model if len(tokens) >= PREFILL_MIN_TOKENS else None
        cache = self.pool.prompt_cache if cacheable else None
        if cache is not None and not cache.enabled:
            cache = None
        # Segments computed in one layout, in contexts of one shape, are given to prefills that would compute them so
        owner = (elsewhere or model, n_seq)
        ends = prefill_bounds(tokens, model.segment_marks)
        reused, tick = [], time.perf_counter()
        if cache is not None:  # (segments are cached only once kv_format is known)
            reused = cache.match(owner, tokens, ends, most=len(ends) - 1)
        start = ends[len(reused) - 1] if reused else 0
        cached = kv_blocks.join(model.kv_format, reused, n_seq) if reused else None
        self.prompt_cache_s = time.perf_counter() - tick
        state = None
        if elsewhere is not None:
            rows, state = elsewhere.prefill(tokens, wanted, n_seq, self.seq, cached, start)
            context.load_state(state, self.seq)
        else:
            try:
                if cached is not None:
                    context.load_state(cached, self.seq)
                rows = evaluate_prompt(model, context, self.seq, tokens, wanted, start)
            except BaseException:  # an interrupt too: the sequence must not keep half a prompt
                context.remove(self.seq, 0)
                raise
        self._length, self.prompt_tokens_reused = len(tokens), start
        if cache is not None:  # every new segment, the last too: a longer prompt cut there, or the same again, reuses it
            tick = time.perf_counter()
            spans = list(zip([start, *ends[len(reused):-1]], ends[len(reused):]))
            cut = kv_blocks.split(state or context.save_state(self.seq), spans)
            if cut is not None:
                model.kv_format, segments = cut
                cache.insert(owner, tokens, ends, len(reused), segments)
            self.prompt_cache_s += time.perf_counter() - tick
        return rows

    def rollback(self, length: int) -> None:
        if length < self._length:
            self.check_room(length).remove(self.seq, length)
            self._length = length
