"""One sequence in a slot of a llama.cpp SlotPool: forward over new tokens (logits of each, or the last), roll back."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from specdec_exact.runtimes.base import run_through
from specdec_exact.runtimes.llamacpp import kv_blocks
from specdec_exact.runtimes.llamacpp.context import BATCH, PREFILL_BLOCK, Context, evaluate, prefill_segments
from specdec_exact.runtimes.llamacpp.kernels import MAX_WIDTH

if TYPE_CHECKING:
    from specdec_exact.runtimes.llamacpp.context import SlotPool

# A prompt's segments of at least this many tokens may run in the model's prefill layout where that differs
# (LlamaCppModel.prefill_model: llama.cpp's own kernels, faster for wide passes on some CPUs); shorter ones, and an
# answer's, run here, in passes of the kernel plan's widths (its multi-column kernels: faster for a few tokens). How
# long a segment must be to run faster there is measured (LlamaCppModel.prefill_min_tokens), never less than this.
PREFILL_MIN_TOKENS = MAX_WIDTH + 1
# The most tokens that merged segments may hold in a pass in a pool of several, where a sequence alone in its pool
# merges them: a request that joins meanwhile waits at most this long a pass for its own first one. (With whole
# column windows, ggml's tiled kernels unpack the weights once per 256 tokens of a pass however wide it is.)
MERGED_IN_BATCH = 2 * PREFILL_BLOCK


def plan_passes(tokens: list[int], segments: list[tuple[int, bool]], start: int, width_at,
                elsewhere_from: int | None, merge_from: int | None = None, most: int = BATCH
                ) -> list[tuple[int, int, bool]]:
    """The passes that prefill tokens[start:] -> (begin, end, whether it runs in the prefill model): an answer's
    segments in pieces of width_at(position) tokens at most (the exact verify width); a segment of elsewhere_from
    tokens or more in one pass in the prefill model (None: there is none); a shorter one here, in pieces of MAX_WIDTH
    tokens at most where there is a prefill model (one pass otherwise). Consecutive segments of the prefill model of
    merge_from tokens or more each that run in one pass (in the prefill model, or here where there is none) share
    passes of up to `most` tokens (merge_from None: never), where that model's passes of that many tokens give the
    same results however they are cut (LlamaCppModel.merges_passes_from): a cold prompt then runs in fewer passes
    than its segments, and each segment's cache entries are still those of a pass of its own.
    `start` is the end of a segment (or 0)."""
    passes, begin = [], 0
    joinable = False  # whether the last pass holds only prefill-model segments of merge_from tokens or more
    for end, answer in segments:
        if end > start:
            wide = not answer and (elsewhere_from is None or end - begin >= elsewhere_from)  # one pass of its own
            long = wide and merge_from is not None and end - begin >= merge_from
            if not wide:
                position = begin
                while position < end:
                    step = min(end, position + max(1, width_at(position) if answer else MAX_WIDTH))
                    passes.append((position, step, False))
                    position = step
            elif long and joinable and end - passes[-1][0] <= most:
                passes[-1] = (passes[-1][0], end, passes[-1][2])
            else:
                passes.append((begin, end, elsewhere_from is not None))
            joinable = long
        begin = end
    return passes


class LlamaCppRunner:
    """Sequence `seq` of a pool's context. Made by SlotPool.take; close() gives the slot back (so does collection)."""

    def __init__(self, pool: SlotPool, seq: int, vocab_size: int, tenant: str | None = None):
        self.pool, self.model, self.seq, self.vocab_size = pool, pool.model, seq, vocab_size
        self.tenant = tenant  # whose prompts it may reuse from the prompt cache (SlotPool.take)
        self.max_length = pool.max_length
        self._tokens: list[int] = []  # the tokens whose entries its cache holds, in order
        self.prompt_length = 0  # of them, its prompt's
        self.prompt_tokens_reused = 0  # tokens of its prompt taken from the prompt cache
        self.prompt_cache_s = 0.0  # seconds its prefill spent looking up, joining, cutting and storing blocks
        self._refusal: str | None = None  # why this runner may no longer run (its slot was taken over or closed)
        self._release = weakref.finalize(self, pool.give, seq)
        # Whether its prompts' long segments may share passes: None as calibrated (in a pool of one, and in a pool of
        # several where LlamaCppModel.merges_in_slots), True or False as a calibration sets it
        self.merges: bool | None = None
        self.prefill_passes = 0  # the passes its last prompt took

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
        passes may be fused with other sequences' or run alone in its slot, no wider than the batch calibration
        found a sequence's passes alone in a slot exact, and one token beyond the longest context it checked (its
        slots hold a little more than that: the calibration's passes must fit in them)."""
        if self.pool.sequences == 1:
            return self.model.verify_width(length)
        if length > max(self.model.batch_calibration["contexts"]):
            return 1
        return min(self.model.verify_width(length), self.model.alone_in_slot_width)

    @property
    def alone(self) -> bool:
        """Whether no other sequence holds a slot of its pool (none waits for its passes)."""
        return self.pool.sequences == 1 or self.pool.free == self.pool.sequences - 1

    @property
    def length(self) -> int:
        return len(self._tokens)

    def check_room(self, needed: int) -> Context:
        """This runner's context, ready for a sequence of `needed` tokens."""
        if self._refusal is not None:
            raise RuntimeError(self._refusal)
        return self.pool.context_for(needed)

    def advance(self, tokens: list[int]) -> None:
        """These tokens of this sequence were evaluated (by the pool's fused pass, or put into its cache)."""
        self._tokens += tokens

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError("the llama.cpp runtime runs one sequence at a time (batch size 1)")
        tokens = input_ids[0].tolist()
        if not tokens:
            raise ValueError("forward needs at least one token")
        wanted = [not last_only or i == len(tokens) - 1 for i in range(len(tokens))]
        if not self._tokens:
            rows = run_through(self._prefill(tokens, wanted, cacheable=last_only))
        else:
            context = self.check_room(self.length + len(tokens))
            pieces = []
            for start in range(0, len(tokens), BATCH):  # in passes of at most BATCH tokens
                piece = tokens[start:start + BATCH]
                entries = [(self.seq, self.length + i, token, want)
                           for i, (token, want) in enumerate(zip(piece, wanted[start:start + BATCH]))]
                pieces.append(evaluate(self.model, context, entries))
                self._tokens += piece
            rows = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return torch.from_numpy(rows)[None][..., : self.vocab_size]  # [1, rows, vocab]

    def prefill(self, input_ids: torch.Tensor) -> Iterator[None]:
        """A new sequence's prompt [1, n], pass by pass: the generator yields after each pass but the last and returns
        the last token's logits [1, 1, vocab] (what forward(input_ids, last_only=True) gives). The passes are those
        forward runs, so interleaving other sequences' passes between them changes nothing; closing the generator
        before it ends leaves the sequence empty."""
        tokens = input_ids[0].tolist()
        if input_ids.shape[0] != 1 or not tokens or self._tokens:
            raise ValueError("prefill takes a new sequence's prompt: one row of at least one token")
        rows = yield from self._prefill(tokens, [i == len(tokens) - 1 for i in range(len(tokens))], cacheable=True)
        return torch.from_numpy(rows)[None][..., : self.vocab_size]

    def _segments(self, tokens: list[int]) -> list[tuple[int, bool]]:
        return prefill_segments(tokens, self.model.segment_marks, self.model.answer_start)

    def _prefill(self, tokens: list[int], wanted: list[bool], cacheable: bool) -> Iterator[None]:
        """A new sequence's first tokens (a prompt), in the passes of plan_passes along its segments
        (context.prefill_segments), yielding between passes; the leading segments come from the prompt cache where
        it holds them, and the prompt's other segments go into it. cacheable: only the last token's logits are
        wanted (a hit has no logits for the tokens it reuses). -> (the generator's value) the wanted rows."""
        context = self.check_room(len(tokens))
        model, n_seq = self.model, context.n_seq
        cache = self.pool.prompt_cache if cacheable else None
        if cache is not None and not cache.enabled:
            cache = None
        segments = self._segments(tokens)
        ends = [end for end, _ in segments]
        reused, tick = [], time.perf_counter()
        if cache is not None:  # (segments are cached only once kv_format is known)
            reused = cache.match(self._owner(n_seq), tokens, ends, most=len(ends) - 1)
        start = ends[len(reused) - 1] if reused else 0
        # Fewer new tokens than any segment the prefill model takes run here whatever its calibration says: the kernel
        # plan's own timing prefills 16 tokens, and must not calibrate the split under the plan it is choosing.
        elsewhere = model.prefill_min_tokens if len(tokens) - start >= PREFILL_MIN_TOKENS else None
        passes = plan_passes(tokens, segments, start, self.verify_width, elsewhere)
        merges = self.merges if self.merges is not None else self.pool.sequences == 1 or model.merges_in_slots
        merge_from = model.merges_passes_from if merges else None
        merged = None  # the passes with long segments merged, which this runner takes while it is alone (_run)
        if merge_from is not None:
            most = BATCH if self.pool.sequences == 1 else MERGED_IN_BATCH
            merged = plan_passes(tokens, segments, start, self.verify_width, elsewhere, merge_from, most)
        try:
            if reused:
                context.load_state(kv_blocks.join(model.kv_format, reused, n_seq), self.seq)
            self.prompt_cache_s = time.perf_counter() - tick
            rows = yield from self._run(tokens, wanted, passes, merged)
        except BaseException:  # an interrupt or a closed generator too: the sequence must not keep half a prompt
            if self._refusal is None:
                self.pool.context.remove(self.seq, 0)
            raise
        self._tokens, self.prompt_tokens_reused, self.prompt_length = list(tokens), start, len(tokens)
        if cache is not None:  # every new segment, the last too: a longer prompt cut there, or the same again, reuses it
            self._store(cache, self.pool.context, tokens, ends, len(reused))
        return rows

    def _owner(self, n_seq: int) -> tuple:
        """The prompt cache's owner of this runner's segments: its model, in contexts of this shape, cut and passed as
        its prompts are (which segments are answers), for its tenant."""
        return self.model, n_seq, self.model.answer_start, self.tenant

    def _run(self, tokens: list[int], wanted: list[bool], passes: list[tuple[int, int, bool]],
             merged: list[tuple[int, int, bool]] | None = None) -> Iterator[None]:
        """Evaluate the passes, yielding between them -> (the generator's value) the wanted rows. Where `merged` (the
        same passes, consecutive long segments sharing some: plan_passes) is given, each pass that starts while this
        runner is alone in its pool runs to the end of the merged pass it starts in: nobody waits for it then, and a
        sequence that joins the pool meanwhile waits at most one merged pass. A pass in the prefill model runs over a
        copy of the sequence's cache in its context, copied back when a pass here follows (and at the end). Other
        sequences' passes may run at the yields; the pool's context is looked up after each."""
        pieces, there, elsewhere = [], None, self.model.prefill_model
        begin, last = passes[0][0], passes[-1][1]
        try:
            while begin < last:
                if pieces:
                    yield
                plan = merged if merged is not None and self.alone else passes
                end, away = next((end, away) for start, end, away in plan if start <= begin < end)
                context = self.check_room(len(tokens))
                if away and there is None:
                    there = elsewhere.prefill_context(context.n_seq, len(tokens))
                    if begin:
                        there.load_state(context.save_state(self.seq), self.seq)
                elif not away and there is not None:
                    self._bring_back(context, there)
                    there = None
                pieces.append(evaluate(elsewhere if away else self.model, there if away else context,
                                       [(self.seq, i, tokens[i], wanted[i]) for i in range(begin, end)]))
                begin = end
            self.prefill_passes = len(pieces)
            if there is not None:
                self._bring_back(self.check_room(len(tokens)), there)
                there = None
        finally:
            if there is not None:  # (interrupted: the prefill context is not left half full and large)
                elsewhere.release_prefill_context()
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _bring_back(self, context: Context, there: Context) -> None:
        context.remove(self.seq, 0)
        context.load_state(there.save_state(self.seq), self.seq)
        self.model.prefill_model.release_prefill_context()

    def _store(self, cache, context: Context, tokens: list[int], ends: list[int], first: int) -> None:
        """Put segments first... of `tokens`, which this runner's cache now holds, into the prompt cache."""
        tick = time.perf_counter()
        spans = list(zip([ends[first - 1] if first else 0, *ends[first:-1]], ends[first:]))
        cut = kv_blocks.split(context.save_state(self.seq), spans)
        if cut is not None:
            self.model.kv_format, segments = cut
            cache.insert(self._owner(context.n_seq), tokens, ends, first, segments)
        self.prompt_cache_s += time.perf_counter() - tick

    def keep_answer(self, answer: list[int]) -> int:
        """A chat answer this runner generated after its prompt, as the next turn of the conversation will send it
        back (its tokens, an end of generation left out), into the prompt cache, as if a prefill had computed it: its
        entries came from one-token passes and passes of the exact verify width, which is how a prompt's answer
        segments are prefilled (plan_passes). The template's end of the message (the model's answer_end) is
        evaluated first. -> tokens cached (0 where there is no cache, no answer to cut, or the cache is gone).
        Call it before close(). Another thread taking this pool's slots waits until it is done (SlotPool.keeping: the
        batch that served the answer keeps it after the client has it)."""
        with self.pool.keeping():  # (the refusal is read within: a takeover either waits for this or came before)
            return self._keep_answer(answer)

    def _keep_answer(self, answer: list[int]) -> int:
        model, cache = self.model, self.pool.prompt_cache
        if (self._refusal is not None or cache is None or not cache.enabled or model.answer_end is None
                or model.kv_format is None):
            return 0
        prompt = self._tokens[:self.prompt_length]
        tokens = [*prompt, *answer, *model.answer_end]
        if len(tokens) > self.max_length:  # the next turn would not fit either
            return 0
        segments = self._segments(tokens)
        ends = [end for end, _ in segments]
        first = next((i for i, (end, _) in enumerate(segments) if end > len(prompt) - 1), None)
        # The answer's segments start where the prompt's last (its answer_start) did
        if first is None or not all(answer for _, answer in segments[first:]):
            return 0
        held = 0
        while held < min(len(tokens), self.length) and self._tokens[held] == tokens[held]:
            held += 1
        if held < (ends[first - 1] if first else 0):
            return 0
        context = self.check_room(len(tokens))
        self.rollback(held)
        for begin, end, _ in plan_passes(tokens, segments, 0, self.verify_width, None):
            if end > held:
                begin = max(begin, held)
                evaluate(model, context, [(self.seq, i, tokens[i], False) for i in range(begin, end)])
                self._tokens += tokens[begin:end]
        self._store(cache, context, tokens, ends, first)
        return len(tokens) - len(prompt)

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.check_room(length).remove(self.seq, length)
            del self._tokens[length:]
