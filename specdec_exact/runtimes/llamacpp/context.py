"""llama.cpp contexts (KV caches) and the pools of sequence slots that runners take from them.

A context holds one sequence, or n sequences of up to `size` tokens each, each laid out as if it were alone. A
SlotPool hands its sequence ids to runners (specdec_exact.runtimes.llamacpp.runner) and takes them back; the runners of
one pool can share passes (SlotPool.forward_many). A pool of one grows its context as its sequence does (the KV
cache copied byte for byte, not recomputed), so one long generation does not reserve its whole context up front.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec_exact.runtimes.base import pass_starts
from specdec_exact.runtimes.llamacpp.kernels import MAX_WIDTH, apply_attention_split, apply_tiled_whole_columns
from specdec_exact.runtimes.llamacpp.library import library, recent_problems

if TYPE_CHECKING:
    from specdec_exact.prompt_cache import PromptCache
    from specdec_exact.runtimes.llamacpp.model import LlamaCppModel
    from specdec_exact.runtimes.llamacpp.runner import LlamaCppRunner

INITIAL_CONTEXT = 2048  # tokens a pool of one allocates up front; it grows by doubling
BATCH = 512  # tokens per llama_decode call (a longer prompt is fed in several), as llama-cpp-python's default n_batch
# A prompt is prefilled in passes along boundaries that its tokens alone decide (prefill_segments): the positions
# PREFILL_BLOCK, 2 * PREFILL_BLOCK, ..., and the start of each message of a chat (a segment mark: LlamaCppModel's
# segment_marks, such as ChatML's <|im_start|>) that leaves at least PREFILL_MIN_SEGMENT tokens on either side before
# the next block boundary and after the boundary before; an answer's start (the model's answer_start: the tokens a
# chat template writes before the assistant's reply) and its end (the next message's start) always, so that an
# answer cached as generated (its tokens and the template's end of message) ends where the next turn's prompt cuts. Cached or not, a prompt's cache entries are then
# computed in the same passes, and the prompt cache (specdec_exact.prompt_cache) keeps them per segment: a system
# message, every message a conversation resent, a long document's blocks. Each pass streams the weights once more
# (BENCHMARKS.md, "Prompt cache").
#
# The segments of an answer (from an answer's start to the next message) are prefilled in passes no wider than the
# model's exact verify width, whose logits and cache entries are those of one-token passes bit for bit: what decoding
# wrote while it generated that answer. So an answer that the runner just generated is cached as if a prefill had
# computed it (LlamaCppRunner.keep_answer), and the next turn of the conversation reuses it.
PREFILL_BLOCK = 128
PREFILL_MIN_SEGMENT = 16

# KV cache element types (ggml_type). ggml's flash attention over an f16 or f32 cache of 512+ cells splits a one-token
# pass across threads and merges partial softmaxes, while wider passes run each row in one sequential sweep, so past
# ~512 tokens a verify pass would no longer reproduce one-token passes: specdec's patch lets a model's passes turn
# the split off (LlamaCppModel.attention_split), and then every pass of up to 63 tokens takes the sequential sweep,
# whatever its width and the context length, over any of these types. Passes of 64+ tokens (a prompt's blocks) take
# ggml's tiled kernel over f16 and f32 caches, whose cost does not grow with the square of the prompt's length as the
# sweep's does: 2.6x faster than over q8_0 on a 4,096-token prompt, measured (BENCHMARKS.md, "KV cache types").
# Without flash attention the K.Q products take width-dependent matrix kernels instead.
KV_CACHE_TYPES = {"f16": 1, "bf16": 30, "q8_0": 8}
KV_CACHE_BYTES = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}  # bytes per cached element (q8_0: 32 int8 + an f16 scale)
DEFAULT_KV_CACHE = "f16"  # llama.cpp's default: the fastest prompts, exact with the split off


# Held over each pass with its kernel plan in force. The plan is a setting of the whole library, so two threads
# running different models (two generators, generate() beside a server) would otherwise run a pass under the other
# model's plan: kernels not checked for its widths. Passes of one process then take turns (on a CPU they share the
# cores anyway).
PASS_LOCK = threading.Lock()


class Context:
    """One llama.cpp context and a reusable batch: n_seq sequences (ids 0..n_seq-1) of `size` tokens each."""

    def __init__(self, model: LlamaCppModel, size: int, n_seq: int = 1):
        lib = self.lib = library()
        params = lib.llama_context_default_params()
        params.n_ctx = size * n_seq
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = n_seq
        params.kv_unified = n_seq == 1
        params.n_threads = params.n_threads_batch = model.threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.type_k = params.type_v = KV_CACHE_TYPES[model.kv_cache]
        params.no_perf = True
        recent_problems()
        self.ctx = lib.llama_init_from_model(model.handle, params)
        if not self.ctx:
            said = recent_problems()
            raise MemoryError(f"llama.cpp could not allocate a context of {size} tokens for {model.path.name}"
                              + (f" (llama.cpp said: {said})" if said else ""))
        self.n_seq = n_seq
        self.size = lib.llama_n_ctx(self.ctx) // n_seq  # tokens per sequence
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(BATCH, 0, 1)
        self._finalizer = weakref.finalize(self, _free_context, lib, self.ctx, self.batch)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def remove(self, seq: int, start: int) -> None:
        """Drop sequence seq's cache entries from position start on."""
        if not self.lib.llama_memory_seq_rm(self.memory, seq, start, -1):
            raise RuntimeError(f"llama.cpp could not remove cache entries past position {start}")

    def save_state(self, seq: int = 0) -> bytes:
        """Sequence seq's KV cache, as bytes that load_state can put into a context of a model of the same weights."""
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(self.ctx, buffer, size, seq)
        return ctypes.string_at(buffer, written)

    def load_state(self, state: bytes, seq: int = 0) -> None:
        """Make sequence seq (empty) hold the KV cache that save_state gave."""
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if self.lib.llama_state_seq_set_data(self.ctx, buffer, len(state), seq) != len(state):
            raise RuntimeError(f"llama.cpp could not restore a sequence's cache ({len(state)} bytes) into sequence "
                               f"{seq} of a context of {self.size} tokens")

    def free(self) -> None:
        self._finalizer()


def _free_context(lib, ctx, batch) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)


def prefill_segments(tokens: list[int], marks: frozenset[int], answer_start: tuple[int, ...] | None = None
                     ) -> list[tuple[int, bool]]:
    """(end, whether it is part of an answer) of each segment of `tokens`, in order (the last ends at len(tokens)):
    see PREFILL_BLOCK. Each boundary depends on the tokens before it and the few at it, so prompts that start alike
    are cut alike up to where they part (and a prompt that ends with an answer's end of message is cut as every
    longer one: the next message starts with a boundary); a segment is part of an answer when the last mark at or before its start
    begins answer_start."""
    answer_start = tuple(answer_start or ())
    segments, last, in_answer = [], 0, False

    def answers_at(i: int) -> bool:
        return bool(answer_start) and tuple(tokens[i:i + len(answer_start)]) == answer_start

    if tokens and tokens[0] in marks:
        in_answer = answers_at(0)
    kind = in_answer
    for i in range(1, len(tokens)):
        token = tokens[i]
        mark = token in marks
        answer = mark and answers_at(i)
        if i % PREFILL_BLOCK == 0 or answer or (mark and in_answer) or (
                mark and i - last >= PREFILL_MIN_SEGMENT and -i % PREFILL_BLOCK >= PREFILL_MIN_SEGMENT):
            segments.append((i, kind))
            last = i
            if mark:
                in_answer = answer
            kind = in_answer
        elif mark:
            in_answer = answer  # a message too short to be a segment: the next segment's kind follows it
    if tokens:
        segments.append((len(tokens), kind))
    return segments


def prefill_bounds(tokens: list[int], marks: frozenset[int], answer_start: tuple[int, ...] | None = None
                   ) -> list[int]:
    """Where the segments of `tokens` end (prefill_segments)."""
    return [end for end, _ in prefill_segments(tokens, marks, answer_start)]


def evaluate(model: LlamaCppModel, context: Context, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
    """One llama_decode of model's over entries (sequence id, position, token, whether its logits are wanted), under
    the model's kernel plan -> the wanted rows [wanted, n_vocab], in order (copied once out of llama.cpp's buffer,
    which its next pass overwrites). If it fails, every sequence in it is cut back to where its tokens start (the
    cache may hold part of the batch), so that its runner stays consistent."""
    plan = model.kernel_plan  # (its first use calibrates it, with passes of its own: before taking the lock)
    whole_columns = model.tiled_whole_columns if len(entries) > MAX_WIDTH else None  # (the kernel plan's widths: no)
    lib, batch, n_vocab = context.lib, context.batch, model.n_vocab
    for i, (seq, position, token, want) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, want
        batch.seq_id[i][0] = seq
    batch.n_tokens = len(entries)
    pass_starts()
    with PASS_LOCK:  # the plan is one setting of the library: no other thread's pass may change it mid-pass
        plan.apply()
        apply_attention_split(model.attention_split)
        if whole_columns is not None:
            apply_tiled_whole_columns(whole_columns)
        recent_problems()  # (what llama.cpp reports from here on is this pass's)
        status = lib.llama_decode(context.ctx, batch)
    if status != 0:
        starts: dict[int, int] = {}
        for seq, position, _, _ in entries:
            starts.setdefault(seq, position)
        for seq, start in starts.items():
            lib.llama_memory_seq_rm(context.memory, seq, start, -1)
        said = recent_problems()
        raise RuntimeError(f"llama.cpp failed to evaluate {len(entries)} tokens (llama_decode returned {status}"
                           + (f"; llama.cpp said: {said})" if said else ")"))
    wanted = [i for i, (_, _, _, want) in enumerate(entries) if want]
    rows = np.empty((len(wanted), n_vocab), dtype=np.float32)
    for row, i in enumerate(wanted):
        rows[row] = np.ctypeslib.as_array(lib.llama_get_logits_ith(context.ctx, i), shape=(n_vocab,))
    return rows


# How long taking a pool's slots from another thread waits for what the batch before still does with them: keeping its
# last answers for their next turns after their clients have them (Batch.keep_answers), a pass each (44-53 ms on a
# 2-core Zen 4)
RELEASE_WAIT_S = 10.0


class SlotPool:
    """Sequence slots of one context of a model, handed to runners (take) and taken back (LlamaCppRunner.close).

    sequences > 1: that many sequences of max_length tokens each, allocated up front. sequences == 1: a context that
    grows with its sequence up to max_length; with takeover, taking its slot while a runner holds it hands the slot
    over (the old runner then refuses to run rather than read a cache that is no longer its own): what a model's
    generate() does when an earlier stream was left unfinished. Its sequences prefill their prompts through
    prompt_cache where one is set (LlamaCppModel.pool sets the requests' cache; a calibration's pools have none).
    """

    def __init__(self, model: LlamaCppModel, sequences: int = 1, max_length: int | None = None,
                 takeover: bool = False):
        if sequences < 1:
            raise ValueError(f"a pool holds at least one sequence, got {sequences}")
        self.model, self.sequences, self.takeover = model, sequences, takeover
        self.prompt_cache: PromptCache | None = None
        self.max_length = min(max_length or model.max_length, model.max_length)
        size = self.max_length if sequences > 1 else min(INITIAL_CONTEXT, self.max_length)
        self.context = Context(model, size, n_seq=sequences)
        self._free = list(range(sequences))
        self._holders: dict[int, weakref.ref] = {}
        # A runner keeping its answer for the next turn may still pass over its slot after its client has the
        # answer (Batch.keep_answers), in the thread of the batch that served it: whoever takes this pool's slots
        # from another thread waits for that first (take, LlamaCppModel.pool)
        self._keeping = 0
        self._changed = threading.Condition()  # notified as slots come back and as keeping ends

    @property
    def free(self) -> int:
        """Slots that take() can hand out now."""
        return len(self._free) if not self.takeover else self.sequences

    @property
    def idle(self) -> bool:
        return len(self._free) == self.sequences

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to timeout seconds for every slot to come back -> whether they all did."""
        with self._changed:
            return self._changed.wait_for(lambda: self.idle, timeout)

    @contextlib.contextmanager
    def keeping(self):
        """A runner of this pool keeps its answer for the next turn within this block (LlamaCppRunner.keep_answer)."""
        with self._changed:
            self._keeping += 1
        try:
            yield
        finally:
            with self._changed:
                self._keeping -= 1
                self._changed.notify_all()

    def take(self, vocab_size: int, tenant: str | None = None) -> LlamaCppRunner:
        """A runner on the lowest free slot: the sequences in use stay consecutive where they can, so that a fused
        pass over them runs as few sub-passes (LlamaCppModel.fused_pass_cost). Its prompts are reused from and cached
        in the prompt cache for this tenant's runners alone."""
        from specdec_exact.runtimes.llamacpp.runner import LlamaCppRunner

        with self._changed:  # (a runner keeping its answer reads its refusal once this lock lets it: keeping)
            if not self._changed.wait_for(lambda: not self._keeping, RELEASE_WAIT_S):
                raise RuntimeError(f"an answer of this pool was still being kept after {RELEASE_WAIT_S:g} s")
            if not self._free and self.takeover:
                for holder in list(self._holders.values()):
                    runner = holder()
                    if runner is not None:
                        runner.evict("another sequence took over this model's llama.cpp context; start a new runner")
            if not self._free:
                raise RuntimeError(f"all {self.sequences} sequence slots of this pool are in use: "
                                   "close a runner first (or make a pool with more)")
            if not self.context.alive:
                raise RuntimeError("this pool was closed; make a new one")
            seq = min(self._free)
            self._free.remove(seq)
            runner = LlamaCppRunner(self, seq, vocab_size, tenant)
            self._holders[seq] = weakref.ref(runner)
        return runner

    def give(self, seq: int) -> None:
        """Take slot seq back, emptied."""
        if self.context.alive:
            self.context.remove(seq, 0)
        self._holders.pop(seq, None)
        with self._changed:
            if seq not in self._free:
                self._free.append(seq)
            self._changed.notify_all()

    def context_for(self, needed: int) -> Context:
        """The context, grown first if one sequence needs `needed` tokens (a pool of one only)."""
        if needed > self.max_length:
            raise ValueError(f"{needed} tokens exceed this sequence's context length of {self.max_length} tokens")
        if needed > self.context.size:
            old = self.context
            size = min(self.max_length, max(2 * old.size, -(-needed // 1024) * 1024))
            new = Context(self.model, size)
            new.load_state(old.save_state())
            old.free()
            self.context = new
        return self.context

    def forward_many(self, items: list[tuple[LlamaCppRunner, torch.Tensor]]) -> list[torch.Tensor]:
        """Several sequences' new tokens in one llama.cpp pass -> each one's logits [1, n, vocab], as its runner's
        forward would give them. With specdec's kernels each token's logits are those of a one-token pass of its own
        sequence while the pass holds at most the model's batch_width tokens (the calibration checks it)."""
        entries = []
        for runner, ids in items:
            if runner.pool is not self:
                raise ValueError("forward_many takes runners of this pool")
            tokens = ids[0].tolist()
            runner.check_room(runner.length + len(tokens))
            entries += [(runner.seq, runner.length + i, token, True) for i, token in enumerate(tokens)]
        if len(entries) > BATCH:
            raise ValueError(f"one pass holds at most {BATCH} tokens, got {len(entries)}")
        # In order of sequence id: llama.cpp puts only sequences of consecutive ids, in increasing order, into one
        # sub-pass (see fused_pass_cost); the rows come back in the order of the items.
        order = sorted(range(len(entries)), key=lambda e: entries[e][:2])
        rows = [None] * len(entries)
        for e, row in zip(order, evaluate(self.model, self.context, [entries[e] for e in order])):
            rows[e] = row
        outputs, start = [], 0
        for runner, ids in items:
            n = ids.shape[1]
            outputs.append(torch.from_numpy(np.stack(rows[start:start + n]))[None, :, : runner.vocab_size])
            runner.advance(ids[0].tolist())
            start += n
        return outputs

    def close(self) -> None:
        """Free the context (once no answer is being kept in it); runners still holding slots refuse to run."""
        with self._changed:
            self._changed.wait_for(lambda: not self._keeping, RELEASE_WAIT_S)
            for holder in list(self._holders.values()):
                runner = holder()
                if runner is not None:
                    runner.evict("this runner's pool was closed; start a new runner")
            self.context.free()
