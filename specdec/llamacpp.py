"""The llama.cpp runtime: GGUF weights evaluated by llama.cpp's CPU kernels, behind the same Runner interface.

Only evaluation and the KV cache live in llama.cpp (through llama-cpp-python's bindings of its C API); drafting,
sampling and verification stay in specdec's own code, so exactness is decided in one place for every runtime.

A LlamaCppModel is the memory-mapped weights plus one llama.cpp context (one KV cache). A runner claims the context
for one sequence; starting another runner on the same model hands the context over, and the old runner refuses to
run rather than read a cache that is no longer its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import weakref
from pathlib import Path

import numpy as np
import torch

from specdec.kernels import LLAMA_CPP as LLAMA_CPP_KERNELS
from specdec.kernels import KernelPlan, candidates, measure_kernel_plan, multi_column_kernels
from specdec.runtimes import LLAMA_CPP

PIN = "llama-cpp-python==0.3.36"
INITIAL_CONTEXT = 2048  # tokens of KV cache allocated up front; grows by doubling (28 KB per token on the 1.5B)
BATCH = 512  # tokens per llama_decode call (a longer prompt is fed in several), as llama-cpp-python's default n_batch

# KV cache element types (ggml_type). ggml's flash attention over an f16 or f32 cache of 512+ cells splits a one-token
# pass across threads and merges partial softmaxes, while wider passes run each row in one sequential sweep, so past
# ~512 tokens a verify pass no longer reproduces one-token passes (measured: logits 0.22-0.70 apart at 600 cached
# tokens on Qwen2.5-Coder-1.5B). Over any other cache type every pass takes the sequential sweep, whatever its width
# and the context length. Without flash attention the K.Q products take width-dependent matrix kernels instead.
KV_CACHE_TYPES = {"f16": 1, "bf16": 30, "q8_0": 8}
# Measured on Qwen2.5-Coder-1.5B Q4_K_M, 2 threads, AMD EPYC with AVX-512, the three caches interleaved: a one-token
# pass after 16 / 600 / 2000 / 4096 cached tokens costs 38.8 / 46.8 / 59.1 / 80.6 ms over q8_0, 38.9 / 47.4 / 58.5 /
# 79.9 over bf16 and 38.2 / 45.2 / 50.9 / 63.5 over f16; q8_0 and bf16 are exact up to 7 tokens at every one of those
# lengths, f16 beyond 16 tokens only at width 1; perplexity on 2,000 tokens of held-out code 2.4797 for both against
# 2.4743 (+0.2%). q8_0, because a separate bf16 run once took 267 ms at 4096 tokens (q8_0: 82): half the bytes per
# cached token stay in the CPU's caches longer.
DEFAULT_KV_CACHE = "q8_0"
DEFAULT_BATCH_SLOTS = 8  # sequences a model's batch context holds unless new_batch_runner is asked for more
DEFAULT_SLOT_TOKENS = 4096  # KV cache per batched sequence, prompt and new tokens


class LlamaCppUnavailable(ValueError):
    """The llama.cpp runtime was asked for, but llama-cpp-python is not installed in this environment."""


def _lib():
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable(
            f"the llama.cpp runtime needs {PIN}: run `make setup` (it builds the wheel once and caches it), or use "
            "--runtime torch") from None
    if not getattr(_lib, "ready", False):
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())  # model loading chatter would bury our own output
        _lib.ready = True
    return llama_cpp


def _ignore_log(level, text, user_data):
    return None


try:
    import llama_cpp as _llama_cpp

    _QUIET = _llama_cpp.llama_log_callback(_ignore_log)  # kept alive here: llama.cpp holds the pointer
except ImportError:
    _QUIET = None


def installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def load(spec, tokenizer=None, threads: int | None = None,
         kv_cache: str = DEFAULT_KV_CACHE) -> tuple[LlamaCppModel, object]:
    """A registry name, a .gguf file or a loaded LlamaCppModel -> (model, transformers tokenizer read from the GGUF)."""
    from transformers import AutoTokenizer

    from specdec import registry

    if isinstance(spec, LlamaCppModel):
        model = spec
    else:
        text = str(spec)
        if text in registry.MODELS:
            path = registry.gguf_file(text)
        elif text.endswith(".gguf"):
            path = Path(text).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
        else:
            raise ValueError(f"the llama.cpp runtime reads GGUF files: give a registry name "
                             f"({', '.join(registry.MODELS)}) or a .gguf file, not {text!r}; or use --runtime torch")
        model = LlamaCppModel(path, threads, kv_cache)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(registry.gguf_tokenizer_dir(model.path), local_files_only=True)
    return model, tokenizer


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LlamaCppModel:
    """A GGUF model loaded by llama.cpp: weights memory-mapped (shared by every runner), one context at a time."""

    runtime = LLAMA_CPP

    def __init__(self, path: str | os.PathLike, threads: int | None = None, kv_cache: str = DEFAULT_KV_CACHE,
                 repack: bool | str = "auto", prefill_repack: bool | str | None = "auto"):
        lib = _lib()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if kv_cache not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache!r}")
        self.kv_cache = kv_cache
        if repack not in (True, False, "auto"):
            raise ValueError(f"repack must be True, False or 'auto', got {repack!r}")
        # llama.cpp's repacked weight layouts: measured on Qwen2.5-Coder-1.5B Q4_K_M, 2 threads, one-token passes
        # took 30.5 instead of 40.3 ms on an AVX-512 EPYC but 64 instead of 56 ms on an AVX2 one, and llama.cpp's own
        # loop crashed with them on an AMX Xeon. So "auto" measures, per CPU, and keeps the faster. (Without
        # specdec's kernel patch, native/, their multi-token kernels round differently from 4 tokens up; with it,
        # passes of up to 16 tokens reproduce one-token passes in either layout. The calibration checks, whichever.)
        if prefill_repack not in (True, False, None, "auto"):
            raise ValueError(f"prefill_repack must be True, False, None or 'auto', got {prefill_repack!r}")
        layouts = choose_layouts(self.path, self.threads) if repack == "auto" else {}
        self.repack = layouts.get("repack", repack)
        if prefill_repack == "auto":  # the other layout only where it was measured faster for prompts
            prefill_repack = layouts.get("prefill_repack", self.repack)
            prefill_repack = None if prefill_repack == self.repack else prefill_repack
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = self.repack
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}: not a GGUF language model it supports")
        self._live_context = [None, None]  # what the finalizer frees with the model: the current context, prefill's
        weakref.finalize(self, _free, lib, self._model, self._live_context)
        if lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model):
            raise ValueError(f"{self.path.name} has recurrent layers, whose state cannot be rolled back; "
                             "speculative decoding needs full attention in every layer")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.max_length = lib.llama_model_n_ctx_train(self._model)
        self.eos_ids = frozenset(i for i in range(self.n_vocab) if lib.llama_vocab_is_eog(self._vocab, i))
        self._context: _Context | None = None
        self._costs: dict | None = None
        self._exact_widths: dict[int, int] | None = None
        self._batch_calibration: dict | None = None
        self._kernel_plan: KernelPlan | None = None
        self._kernel_calibration: dict | None = None
        self._slots: _Slots | None = None  # the batch context, created by the first new_batch_runner
        # Prompts in the other weight layout where that is faster (measured per CPU: on an AVX-512 EPYC, llama.cpp's
        # tiled kernels over the plain layout prefilled 192 tokens in 1.45 s, its repacked layout in 2.05 s, while
        # one-token passes are faster repacked): the same weights, memory-mapped from the same file, loaded a second
        # time; the prompt's KV cache is then copied into this model's context (PREFILL_MIN_TOKENS).
        self.prefill_model = None if prefill_repack is None else LlamaCppModel(
            self.path, self.threads, kv_cache, repack=prefill_repack, prefill_repack=None)
        if self.prefill_model is not None:  # its passes are prompts (a last piece of one can be short): as released
            self.prefill_model._kernel_plan = KernelPlan.uniform(LLAMA_CPP_KERNELS)

    @property
    def kernel_plan(self) -> KernelPlan:
        """Which kernels take this model's passes of each width 1-16 (wider ones take llama.cpp's own): the fastest
        exact ones on this machine (kernel_calibration). Set in the library before each of the model's passes."""
        if self._kernel_plan is None:
            self._kernel_plan = KernelPlan.from_json(self.kernel_calibration["plan"])
        return self._kernel_plan

    @property
    def kernel_calibration(self) -> dict:
        """What specdec.kernels.measure_kernel_plan found (every candidate's time and exactness per width, and the
        plan), measured once per model file, llama.cpp build, CPU, threads, cache type and layout, then cached."""
        if self._kernel_calibration is None:
            self._kernel_calibration = _cached_json(
                self.path, "kernel-plan", f"{self.threads}|{self.kv_cache}|{self.repack}",
                lambda: measure_kernel_plan(self),
                {"threads": self.threads, "kv_cache": self.kv_cache, "repack": self.repack})
        return self._kernel_calibration

    @property
    def costs(self) -> dict:
        """{"pass_s": {width: seconds of a pass over that many tokens}}, measured once per model file, llama.cpp
        build, CPU, threads and cache type, then read from the cache (see measure_costs): priors for k="auto"."""
        if self._costs is None:
            self._costs = _cached(self, "costs", measure_costs)
        return self._costs

    @property
    def exact_widths(self) -> dict[int, int]:
        """{cached tokens: the widest pass whose logits equal one-token passes bit for bit there}, measured once like
        costs (see measure_exact_widths). Only a target needs it: drafts never have to be exact."""
        if self._exact_widths is None:
            found = _cached(self, "exactness", measure_exact_widths)
            self._exact_widths = {int(length): width for length, width in found["exact_width"].items()}
        return self._exact_widths

    def prepare_as_target(self) -> None:
        """Calibrate what a target needs (its exact verify and batch widths) now, not inside the first generation's
        or request's timing."""
        self.exact_widths
        self.batch_width

    def verify_width(self, length: int) -> int:
        """The widest pass the engine may verify after `length` cached tokens (>= 1).

        llama.cpp picks kernels by the number of tokens in a pass (and, for some cache types, by the context
        length), and they round differently; a verify pass wider than this could flip a near-tie that plain
        decoding would not. Up to the longest calibrated context it is the narrowest width found exact at any
        calibrated length; beyond that nothing was checked, so passes there verify one token.
        """
        widths = self.exact_widths
        return min(widths.values()) if length <= max(widths) else 1

    @property
    def verify_slope(self) -> float:
        """Extra seconds per extra token of a pass, relative to a one-token pass (0: flat, 1: linear)."""
        pass_s = {int(w): s for w, s in self.costs["pass_s"].items()}
        slopes = sorted((s / pass_s[1] - 1) / (w - 1) for w, s in pass_s.items() if w > 1)
        return max(0.0, slopes[len(slopes) // 2]) if slopes else 0.0

    def verify_cost(self, width: int) -> float:
        """Seconds of a pass over `width` tokens in one-token passes, from the calibrated curve (a straight line at
        the median slope beyond its widest point)."""
        pass_s = {int(w): s for w, s in self.costs["pass_s"].items()}
        widest = max(pass_s)
        if width <= widest:
            return pass_s[width] / pass_s[1]
        return pass_s[widest] / pass_s[1] + self.verify_slope * (width - widest)

    def fused_pass_cost(self, items: list[tuple[LlamaCppRunner, int]]) -> float:
        """The cost of one forward_many over these runners' next tokens (that many each), in one-token passes.

        Over a cache that keeps each sequence apart (specdec's batch contexts), llama.cpp evaluates a pass in
        sub-passes, each over a run of sequences with consecutive ids that takes equally many tokens from every one
        of them (llama_batch_allocr::split_equal). So widths [1, 3, 3, 1] over sequences 0-3 run as 4 x 1 tokens,
        then 2 x 2; [3, 1, 3, 1] as 4 x 1, then 1 x 2 twice; sequences 0, 1, 3 and 4 as two sub-passes of two.
        Each sub-pass streams the weights once and costs what a pass over as many tokens of one sequence costs
        (measured on a 2-core AMD EPYC with AVX-512, 2 threads: 2 x 2, 1 x 4 and 4 x 1 tokens took 1.90-1.92
        one-token passes; 8 x 1 tokens 96 ms over sequences 0-7 and 245 ms over 7, 6, ..., 0 in that order, before
        forward_many sorted them)."""
        left = {runner.seq: n for runner, n in items if n > 0}
        cost = 0.0
        while left:
            run = []
            for seq in sorted(left):
                if run and seq != run[-1] + 1:
                    break
                run.append(seq)
            taken = min(left[seq] for seq in run)
            cost += self.verify_cost(taken * len(run))
            for seq in run:
                left[seq] -= taken
                if not left[seq]:
                    del left[seq]
        return cost

    @property
    def step_s(self) -> float:
        """Seconds of one one-token pass (at the calibration's short context)."""
        return self.costs["pass_s"]["1"]

    def new_runner(self, vocab_size: int) -> LlamaCppRunner:
        return LlamaCppRunner(self, vocab_size)

    def new_batch_runner(self, vocab_size: int, slots: int = DEFAULT_BATCH_SLOTS,
                         slot_tokens: int = DEFAULT_SLOT_TOKENS) -> LlamaCppRunner:
        """A sequence in a free slot of the model's batch context (made with `slots` sequences of up to `slot_tokens`
        tokens each; made again, bigger, when more slots are asked for while none is in use): such runners can share
        passes (forward_many). Its slot is freed when the runner is closed or collected."""
        self.reserve_batch(slots, slot_tokens)
        return LlamaCppRunner(self, vocab_size, slots=self._slots)

    def reserve_batch(self, slots: int = DEFAULT_BATCH_SLOTS, slot_tokens: int = DEFAULT_SLOT_TOKENS) -> None:
        """Make the batch context for at least `slots` sequences now rather than at the first new_batch_runner (a
        server's first request would wait for it); an idle smaller one is made again, bigger."""
        if self._slots is not None and self._slots.total < slots and self._slots.idle:
            self._slots.context.free()
            self._slots = None
        if self._slots is None:
            self._slots = _Slots(_Context(self, min(slot_tokens, self.max_length), n_seq=slots))

    def free_batch_slots(self, slots: int = DEFAULT_BATCH_SLOTS) -> int:
        """Sequences that new_batch_runner(..., slots) can still start now."""
        if self._slots is None or (self._slots.idle and self._slots.total < slots):
            return slots
        return len(self._slots.free)

    def forward_many(self, items: list[tuple[LlamaCppRunner, torch.Tensor]]) -> list[torch.Tensor]:
        """Several sequences' new tokens in one llama.cpp pass -> each one's logits [1, n, vocab], as its runner's
        forward would give them. The runners must hold slots of one batch context of this model. With
        specdec's kernels each token's logits are those of a one-token pass of its own sequence while the pass holds
        at most batch_width tokens (the calibration checks it)."""
        if not items:
            return []
        context = items[0][0].context
        entries = []
        for runner, ids in items:
            if runner.model is not self or runner._slots is None or runner.context is not context:
                raise ValueError("forward_many takes runners in slots of one batch context of this model "
                                 "(new_batch_runner)")
            tokens = ids[0].tolist()
            runner._own_context(runner.length + len(tokens))
            entries += [(runner.seq, runner.length + i, token, True) for i, token in enumerate(tokens)]
        if len(entries) > BATCH:
            raise ValueError(f"one pass holds at most {BATCH} tokens, got {len(entries)}")
        # In order of sequence id: llama.cpp puts only sequences of consecutive ids, in increasing order, into one
        # sub-pass (see fused_pass_cost); the rows come back in the order of the items.
        order = sorted(range(len(entries)), key=lambda e: entries[e][:2])
        rows = [None] * len(entries)
        for e, row in zip(order, _evaluate(self, context, [entries[e] for e in order])):
            rows[e] = row
        outputs, start = [], 0
        for runner, ids in items:
            n = ids.shape[1]
            outputs.append(torch.from_numpy(np.stack(rows[start:start + n]))[None, :, : runner.vocab_size])
            runner._length += n
            start += n
        return outputs

    @property
    def batch_width(self) -> int:
        """The most tokens, over one or several sequences, that a pass may hold while every token still gets the
        logits of a one-token pass of its own sequence (measured once, like exact_widths: see measure_batch_width)."""
        return min(self.batch_calibration["batch_width"], min(self.exact_widths.values()))

    @property
    def prefills_in_slots_exactly(self) -> bool:
        """Whether a prompt prefilled in a batch slot, beside other sequences, gives the logits and cache of a prompt
        prefilled alone (measure_batch_width). Where it does not, a batch must serve one request at a time."""
        return self.batch_calibration["prefill_in_slot_exact"]

    @property
    def batch_calibration(self) -> dict:
        """What measure_batch_width found for this model file on this machine (measured once, then cached)."""
        if self._batch_calibration is None:
            self._batch_calibration = _cached(self, "batching", measure_batch_width)
        return self._batch_calibration

    def _claim(self, owner: LlamaCppRunner) -> _Context:
        """The model's context, emptied and handed to owner (created on first use)."""
        if self._context is None:
            self._context = _Context(self, min(INITIAL_CONTEXT, self.max_length))
            self._live_context[0] = self._context
        self._context.clear()
        self._context.owner = owner
        return self._context

    def _grow(self, needed: int) -> _Context:
        """A bigger context holding the same sequence: its KV cache is copied byte for byte, not recomputed."""
        old = self._context
        size = min(self.max_length, max(2 * old.size, -(-needed // 1024) * 1024))
        new = _Context(self, size)
        new.load_state(old.save_state())
        new.owner = old.owner
        old.free()
        self._context = new
        self._live_context[0] = new
        return new

    def prefill(self, tokens: list[int], wanted: list[bool], n_seq: int = 1, seq: int = 0
                ) -> tuple[list[np.ndarray], bytes]:
        """Evaluate a new sequence's first tokens as sequence `seq` of a context of n_seq sequences (the shape of the
        context the sequence continues in: llama.cpp restores a sequence only into one of the same shape) -> (the
        wanted logits rows, the sequence's KV cache, for another model of these weights to load: load_state)."""
        context = self._live_context[1]
        if context is None or context.n_seq != n_seq or context.size < len(tokens):
            if context is not None:
                context.free()
            size = max(256, 1 << (len(tokens) - 1).bit_length())  # a power of two: few reallocations
            context = self._live_context[1] = _Context(self, size, n_seq=n_seq)
        context.clear()
        rows = []
        for start in range(0, len(tokens), BATCH):
            rows += _evaluate(self, context, [(seq, start + i, token, want) for i, (token, want) in enumerate(
                zip(tokens[start:start + BATCH], wanted[start:start + BATCH]))])
        state = context.save_state(seq)
        if context.size * n_seq > 2 * INITIAL_CONTEXT:  # a long prompt's cache is not kept around
            context.free()
            self._live_context[1] = None
        return rows, state

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}, threads={self.threads})"


CALIBRATION_WIDTHS = range(2, 17)  # pass widths checked: up to 15 draft tokens, or 16 batched sequences
# Cached tokens before the checked passes: short; past the 512 cells where ggml's attention changes strategy for f16
# caches; and a long context (prompts of a few pages). Beyond the longest, the engine verifies one token at a time.
CALIBRATION_CONTEXTS = (16, 600, 4096)
CALIBRATION_VERSION = 8  # bump when what is measured changes: older cached results are then measured again


def _cached(model: LlamaCppModel, kind: str, measure) -> dict:
    """measure(model), cached per model file, llama.cpp build, CPU, threads, cache type, weight layouts and kernel
    plan (so that what was measured under one plan is never read under another)."""
    plan = model.kernel_plan
    return _cached_json(model.path, kind, f"{model.threads}|{model.kv_cache}|{model.repack}|{plan.key}",
                        lambda: measure(model), {"threads": model.threads, "kv_cache": model.kv_cache,
                                                 "repack": model.repack, "kernel_plan": plan.describe()})


def _cached_json(path: Path, kind: str, settings: str, measure, describe: dict) -> dict:
    """measure(), cached in a JSON file per GGUF file (path, size, mtime), llama.cpp build, CPU flags and settings."""
    import hashlib
    import json
    from importlib.metadata import version

    from specdec import registry

    stat = path.stat()
    cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "") if os.path.exists(
        "/proc/cpuinfo") else os.uname().machine
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version('llama_cpp_python')}|"
                         f"{_kernels_id()}|{multi_column_kernels()}|{cpu}|{settings}|{CALIBRATION_VERSION}".encode()
                         ).hexdigest()[:24]
    cached = registry.cache_root() / "calibration" / f"{path.stem}-{kind}-{key}.json"

    def read() -> dict | None:
        try:
            return json.loads(cached.read_text())["measured"]
        except (OSError, ValueError, KeyError):
            return None

    found = read()
    if found is not None:
        return found
    cached.parent.mkdir(parents=True, exist_ok=True)
    with _calibrating(cached.parent):
        found = read()  # another process may have measured it while this one waited
        if found is None:
            found = measure()
            partial = cached.with_name(cached.name + ".partial")
            partial.write_text(json.dumps({"model": str(path), **describe, "measured": found}) + "\n")
            partial.replace(cached)
    return found


_calibration_depth = 0  # calibrations in progress in this process (one measures what it needs of another)


@contextlib.contextmanager
def _calibrating(folder: Path):
    """One calibration at a time on this machine: timings taken while another process times its own kernels (two
    servers started at once) measure the contention, and the cache would keep them. A process waits for the lock
    (saying so on a terminal), then reads what the other one measured if it was the same."""
    global _calibration_depth
    if _calibration_depth:  # this process holds the lock already
        _calibration_depth += 1
        try:
            yield
        finally:
            _calibration_depth -= 1
        return
    import fcntl

    with open(folder / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if sys.stderr.isatty():
                print("another process is calibrating on this machine: waiting for it ...", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        _calibration_depth = 1
        try:
            yield
        finally:
            _calibration_depth = 0
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def _kernels_id() -> str:
    """A digest of the installed llama.cpp CPU kernels (libggml-cpu): two builds of the same llama-cpp-python release,
    with and without specdec's kernel patch or for another CPU, calibrate differently."""
    import hashlib

    folder = Path(_lib().__file__).parent / "lib"
    libraries = sorted(folder.glob("libggml-cpu*")) or sorted(folder.glob("*ggml*"))
    return hashlib.sha256(libraries[0].read_bytes()).hexdigest()[:16] if libraries else ""


LAYOUT_TIMING_TIMEOUT_S = 600  # loading a model twice, 20 one-token passes and 6 prompts: seconds, even for a 7B
PREFILL_PROBE_TOKENS = 128  # a typical chat prompt, for timing prefills in each layout
# A new sequence's first pass of at least this many tokens (a prompt) runs in the prefill layout where that differs;
# shorter ones stay where they are (the layouts were within a few percent of each other at 32 tokens).
PREFILL_MIN_TOKENS = 32


def choose_layouts(path: Path, threads: int, details: bool = False) -> dict:
    """Which of llama.cpp's weight layouts, plain or repacked for the CPU, give this file on this CPU the faster
    one-token passes ("repack": by 3% or more) and the faster prompts ("prefill_repack"): measured once, in a worker
    process, since the repacked layouts crashed llama.cpp on an AMX Xeon (a crash there says plain for both), then
    cached. details: all that was measured (the times of every candidate kernel in each layout)."""
    found = _cached_json(Path(path), "layouts", f"{threads}|prefill", lambda: _measure_layouts(path, threads),
                         {"threads": threads})
    if details:
        return found
    return {"repack": found["repack"], "prefill_repack": found.get("prefill_repack", found["repack"])}


def _measure_layouts(path: Path, threads: int) -> dict:
    import json
    import subprocess

    if sys.stderr.isatty():
        print(f"timing llama.cpp's weight layouts for {Path(path).name} on this CPU (once) ...", file=sys.stderr)
    # A fresh interpreter, not a multiprocessing worker: that would re-run the caller's script (a script without a
    # __main__ guard would start over in it), and it must not inherit this process's llama.cpp and torch threads.
    code = "import sys; from specdec.llamacpp import _time_layouts; _time_layouts(sys.argv[1], int(sys.argv[2]))"
    try:
        worker = subprocess.run([sys.executable, "-c", code, str(path), str(threads)], capture_output=True,
                                text=True, timeout=LAYOUT_TIMING_TIMEOUT_S)
        exit_code = worker.returncode
        (plain, repacked), (plain_prefill_s, repacked_prefill_s) = json.loads(worker.stdout.splitlines()[-1])
        plain_s, repacked_s = min(plain.values()), min(repacked.values())
    except subprocess.TimeoutExpired:  # hung: as good as a crash
        exit_code = "timeout"
    except (ValueError, IndexError):  # the worker died: with the repacked layouts, or at all
        pass
    else:
        return {"repack": repacked_s < 0.97 * plain_s, "prefill_repack": repacked_prefill_s < 0.97 * plain_prefill_s,
                "one_token_s": {"plain": plain_s, "repacked": repacked_s},
                "one_token_s_by_kernel": {"plain": plain, "repacked": repacked},
                "prefill_s": {"tokens": PREFILL_PROBE_TOKENS, "plain": plain_prefill_s, "repacked": repacked_prefill_s}}
    return {"repack": False, "prefill_repack": False, "worker_exit_code": exit_code}


def _time_layouts(path: str, threads: int) -> None:
    """In the worker: the median seconds of a one-token pass after 16 tokens under each candidate kernel
    (specdec.kernels.candidates, llama.cpp's own among them) in each layout, and of a PREFILL_PROBE_TOKENS prompt,
    plain and repacked layouts and the kernels interleaved, printed as JSON."""
    import json
    import statistics
    import time

    models = [LlamaCppModel(path, threads, repack=repack, prefill_repack=None) for repack in (False, True)]
    for model in models:  # prompts take llama.cpp's own kernels under any plan; no plan is calibrated here
        model._kernel_plan = KernelPlan.uniform(LLAMA_CPP_KERNELS)
    tokens = _probe_tokens(models[0], PREFILL_PROBE_TOKENS)
    runners = [LlamaCppRunner(model, model.n_vocab, private_context=PREFILL_PROBE_TOKENS) for model in models]
    kernels = candidates()
    one_token, prefill = [{kernel: [] for kernel in kernels} for _ in models], [[], []]
    for _ in range(3):
        for runner, times in zip(runners, prefill):
            runner.rollback(0)
            started = time.perf_counter()
            runner.forward(tokens, last_only=True)
            times.append(time.perf_counter() - started)
    for _ in range(9):
        for model, runner, times in zip(models, runners, one_token):
            for kernel in kernels:
                model._kernel_plan = KernelPlan.uniform(kernel)
                runner.rollback(16)
                started = time.perf_counter()
                runner.forward(tokens[:, 16:17])
                times[kernel].append(time.perf_counter() - started)
    print(json.dumps([[{kernel.describe(): statistics.median(t[1:]) for kernel, t in times.items()}
                       for times in one_token], [statistics.median(times) for times in prefill]]))


def _probe_tokens(model: LlamaCppModel, n: int) -> torch.Tensor:
    return torch.arange(n)[None] * 7919 % model.n_vocab  # [1, n] any in-vocabulary tokens


def _one_token_logits(runner: LlamaCppRunner, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of tokens [1, n] fed one pass each -> [n, vocab]."""
    return torch.cat([runner.forward(tokens[:, i:i + 1])[0] for i in range(tokens.shape[1])])


def measure_costs(model: LlamaCppModel, widths=CALIBRATION_WIDTHS, repeats: int = 9) -> dict:
    """Seconds of a pass over 1 token and over each width in widths after 16 cached tokens. Each pass over w tokens is
    timed right after a one-token pass, and what k="auto" and the per-cycle choice read is their ratio: the median of
    `repeats` such pairs per width, times the median one-token pass. On a shared machine a busy moment then slows both
    passes of a pair rather than one side of a ratio (a median of each width's times alone once gave V(2) = 1.23 where
    interleaved probes found 1.38-1.47)."""
    import statistics
    import time

    prefix = CALIBRATION_CONTEXTS[0]
    tokens = _probe_tokens(model, prefix + max(widths))
    runner = LlamaCppRunner(model, model.n_vocab, private_context=tokens.shape[1])
    runner.forward(tokens[:, :prefix], last_only=True)
    runner.forward(tokens[:, prefix:prefix + 1])  # a first pass warms the caches

    def seconds(width: int) -> float:
        runner.rollback(prefix)
        started = time.perf_counter()
        runner.forward(tokens[:, prefix:prefix + width])
        return time.perf_counter() - started

    one_token, ratios = [], {width: [] for width in widths}
    for _ in range(repeats):
        for width in widths:
            one_token.append(seconds(1))
            ratios[width].append(seconds(width) / one_token[-1])
    step = statistics.median(one_token)
    return {"pass_s": {"1": step, **{str(width): step * statistics.median(r) for width, r in ratios.items()}}}


def measure_exact_widths(model: LlamaCppModel, widths=CALIBRATION_WIDTHS, contexts=CALIBRATION_CONTEXTS) -> dict:
    """At each context length (capped by the model's), evaluate the same tokens one at a time and in passes of each
    width in widths -> {"exact_width": {length: the largest w such that every pass of 2..w tokens gives the one-token logits
    bit for bit (1 if none does)}}. The long context costs a prefill of that many tokens, once per machine."""
    from tqdm import tqdm

    found = {}
    lengths = sorted({min(n, model.max_length - max(widths)) for n in contexts})
    # On a terminal only: the long context takes about a minute for a 1.5B model on 2 cores, once.
    for length in tqdm(lengths, desc=f"calibrating {model.path.name} (once): exact verify width after N tokens",
                       unit="context", leave=False, disable=None, file=sys.stderr):
        tokens = _probe_tokens(model, length + max(widths))
        runner = LlamaCppRunner(model, model.n_vocab, private_context=tokens.shape[1])
        runner.forward(tokens[:, :length], last_only=True)
        single = _one_token_logits(runner, tokens[:, length:])
        exact = 1
        for width in widths:
            runner.rollback(length)
            if exact == width - 1 and torch.equal(runner.forward(tokens[:, length:length + width])[0], single[:width]):
                exact = width
        found[str(length)] = exact
    return {"exact_width": found}


def measure_batch_width(model: LlamaCppModel, widths=CALIBRATION_WIDTHS, contexts=CALIBRATION_CONTEXTS,
                        slot_tokens: int = DEFAULT_SLOT_TOKENS) -> dict:
    """The shapes a batch's passes take, each against its sequences' own one-token passes in a context of their own.

    A batch context holds max(widths) sequences of different lengths (each calibrated context length, capped by the
    slot size), in slots that held another sequence before. Each prompt is prefilled in its slot beside the others
    and must give the logits and cache of a prompt prefilled alone. Then, for each w in widths, the fused passes a
    scheduler makes of w tokens: one token from each of w sequences (consecutive sequence ids, and ids with gaps
    where slots were freed), a ragged mix (one sequence with w - 1 tokens beside one with 1), an uneven spread, and
    one sequence alone verifying w tokens in its slot. -> {"batch_width": the largest w such that every pass of
    2..w tokens gave every token its one-token logits bit for bit (1 if none did), "prefill_in_slot_exact": whether
    prompts prefilled in slots equalled prompts prefilled alone, "contexts": the lengths checked}."""
    n = max(widths)
    longest = min(slot_tokens, model.max_length) - n
    lengths = sorted({min(length, longest) for length in contexts})
    prefix_of = [lengths[i % len(lengths)] for i in range(n)]  # slot i's context length
    mixes = {width: batch_mixes(width, n) for width in widths}
    needed = [max(count for width_mixes in mixes.values() for mix in width_mixes for slot, count in mix if slot == i)
              for i in range(n)]  # the most tokens a pass takes from slot i: its one-token passes to compare with
    continuations = [_probe_tokens(model, n * (i + 2))[:, -needed[i]:] for i in range(n)]  # all different
    prompts = {length: _probe_tokens(model, length + 1)[:, 1:] for length in lengths}  # [1, length]
    alone_prefill, alone = {}, [None] * n
    for length, prompt in prompts.items():  # each prompt alone, then each of its slots' continuations one at a time
        runner = LlamaCppRunner(model, model.n_vocab, private_context=length + n)
        alone_prefill[length] = runner.forward(prompt, last_only=True)
        for i in (i for i in range(n) if prefix_of[i] == length):
            runner.rollback(length)
            alone[i] = _one_token_logits(runner, continuations[i])
    slots = _Slots(_Context(model, longest + n, n_seq=n))
    earlier = [LlamaCppRunner(model, model.n_vocab, slots=slots) for _ in range(n)]
    for runner in earlier:  # every slot held a sequence before: a server's slots are reused
        runner.forward(prompts[lengths[-1]][:, :40])
        runner.close()
    runners = [LlamaCppRunner(model, model.n_vocab, slots=slots) for _ in range(n)]
    prefill_exact, states = True, {}
    for i, runner in enumerate(runners):
        length = prefix_of[i]
        if length in states:  # a copy of the slot prefilled before: equal contents, at no second prefill's cost
            slots.context.load_state(states[length], runner.seq)
            runner._length = length
        else:
            prefill_exact &= torch.equal(runner.forward(prompts[length], last_only=True), alone_prefill[length])
            states[length] = slots.context.save_state(runner.seq)
    widest = 1
    for width in widths:
        exact = True
        for mix in mixes[width]:
            items = [(runners[i], continuations[i][:, :count]) for i, count in mix]
            outputs = model.forward_many(items) if len(items) > 1 else [items[0][0].forward(items[0][1])]
            for (i, count), logits in zip(mix, outputs):
                exact &= torch.equal(logits[0], alone[i][:count])
                runners[i].rollback(prefix_of[i])
        if not (exact and widest == width - 1):
            break
        widest = width
    for runner in runners:
        runner.close()
    slots.context.free()
    return {"batch_width": widest, "prefill_in_slot_exact": bool(prefill_exact), "contexts": lengths}


def batch_mixes(width: int, slots: int) -> list[list[tuple[int, int]]]:
    """The fused passes of `width` tokens that a batch over `slots` sequences can make, as (slot, tokens) lists:
    one token from each of `width` sequences with consecutive ids and with gaps between ids, one sequence with
    width - 1 tokens beside one with 1, tokens spread unevenly (3, 1, 2, 3, 1, 2, ...), and one sequence alone."""
    spaced = [*range(0, slots, 2), *range(1, slots, 2)]
    spread, total, i = [], 0, 0
    while total < width:
        count = min((3, 1, 2)[i % 3], width - total)
        spread.append((i % slots, count))
        total, i = total + count, i + 1
    alone = [[(slot, width)] for slot in range(min(3, slots))]  # a batch of one, at each context length
    return [[(i, 1) for i in range(width)], [(spaced[i], 1) for i in range(width)],
            [(min(2, slots - 1), width - 1), (0, 1)], spread, *alone]


def _evaluate(model: LlamaCppModel, context: _Context, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
    """One llama_decode of model's over entries (sequence id, position, token, whether its logits are wanted), under
    the model's kernel plan -> the wanted rows, in order. If it fails, every sequence in it is cut back to where its
    tokens start (the cache may hold part of the batch), so that its runner stays consistent."""
    model.kernel_plan.apply()
    lib, batch, n_vocab = context.lib, context.batch, model.n_vocab
    for i, (seq, position, token, want) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, want
        batch.seq_id[i][0] = seq
    batch.n_tokens = len(entries)
    status = lib.llama_decode(context.ctx, batch)
    if status != 0:
        starts: dict[int, int] = {}
        for seq, position, _, _ in entries:
            starts.setdefault(seq, position)
        for seq, start in starts.items():
            lib.llama_memory_seq_rm(context.memory, seq, start, -1)
        raise RuntimeError(f"llama.cpp failed to evaluate {len(entries)} tokens (llama_decode returned {status})")
    return [np.ctypeslib.as_array(lib.llama_get_logits_ith(context.ctx, i), shape=(n_vocab,)).copy()
            for i, (_, _, _, want) in enumerate(entries) if want]


class _Slots:
    """A batch context's sequence ids, handed to runners and taken back."""

    def __init__(self, context: _Context):
        self.context = context
        self.total = context.lib.llama_n_seq_max(context.ctx)
        self.free = list(range(self.total))

    @property
    def idle(self) -> bool:
        return len(self.free) == self.total

    def take(self) -> int:
        """The lowest free sequence id: the sequences in use stay consecutive where they can, so that a fused pass
        over them runs as few sub-passes (LlamaCppModel.fused_pass_cost)."""
        if not self.free:
            raise RuntimeError(f"all {self.total} batch slots are in use: "
                               "close a runner first (or ask for more slots)")
        seq = min(self.free)
        self.free.remove(seq)
        return seq

    def give(self, seq: int) -> None:
        if self.context.ctx:
            self.context.lib.llama_memory_seq_rm(self.context.memory, seq, 0, -1)
        self.free.append(seq)


def _free(lib, model, context_box) -> None:
    for context in context_box:
        if context is not None:
            context.free()
    lib.llama_model_free(model)


class _Context:
    """One llama.cpp context and a reusable batch: a KV cache for one sequence (id 0), or for n_seq sequences with a
    stream of `size` tokens each (ids 0..n_seq-1), each laid out as if it were alone."""

    def __init__(self, model: LlamaCppModel, size: int, n_seq: int = 1):
        lib = self.lib = _lib()
        params = lib.llama_context_default_params()
        params.n_ctx = size * n_seq
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = n_seq
        params.kv_unified = n_seq == 1
        params.n_threads = params.n_threads_batch = model.threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.type_k = params.type_v = KV_CACHE_TYPES[model.kv_cache]
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(model._model, params)
        if not self.ctx:
            raise MemoryError(f"llama.cpp could not allocate a context of {size} tokens for {model.path.name}")
        self.n_seq = n_seq
        self.size = lib.llama_n_ctx(self.ctx) // n_seq  # tokens per sequence
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(BATCH, 0, 1)
        self.owner = None

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def save_state(self, seq: int = 0) -> bytes:
        """Sequence seq's KV cache, as bytes that load_state can put into a context of a model of the same weights."""
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(self.ctx, buffer, size, seq)
        return bytes(buffer[:written])

    def load_state(self, state: bytes, seq: int = 0) -> None:
        """Make sequence seq (empty) hold the KV cache that save_state gave."""
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if self.lib.llama_state_seq_set_data(self.ctx, buffer, len(state), seq) != len(state):
            raise RuntimeError(f"llama.cpp could not restore a sequence's cache ({len(state)} bytes) into sequence "
                               f"{seq} of a context of {self.size} tokens")

    def free(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


class LlamaCppRunner:
    """One sequence on a LlamaCppModel: forward over new tokens (logits of each, or the last), roll back."""

    def __init__(self, model: LlamaCppModel, vocab_size: int, private_context: int | None = None,
                 slots: _Slots | None = None):
        """private_context: a context of that many tokens of this runner's own (freed with the runner), leaving the
        model's shared one alone: for the calibration, which may run while a sequence is being generated.
        slots: a batch context to take a sequence slot of (freed by close() or with the runner)."""
        self.model = model
        self.vocab_size = vocab_size
        self.max_length = model.max_length
        self.seq, self._slots, self._private = 0, slots, private_context is not None
        if slots is not None:
            self.context, self.seq = slots.context, slots.take()
            self.max_length = min(model.max_length, slots.context.size)
            self._release = weakref.finalize(self, slots.give, self.seq)
        elif private_context is None:
            self.context = model._claim(self)
        else:
            self.context = _Context(model, private_context)
            weakref.finalize(self, self.context.free)
        self._length = 0

    def close(self) -> None:
        """Give a batch slot back (a no-op for other runners)."""
        if self._slots is not None:
            self._release()

    def verify_width(self, length: int) -> int:
        return self.model.verify_width(length)

    @property
    def length(self) -> int:
        return self._length

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError("the llama.cpp runtime runs one sequence at a time (batch size 1)")
        tokens = input_ids[0].tolist()
        if not tokens:
            raise ValueError("forward needs at least one token")
        wanted = [not last_only or i == len(tokens) - 1 for i in range(len(tokens))]
        elsewhere = self.model.prefill_model
        if elsewhere is not None and self._length == 0 and len(tokens) >= PREFILL_MIN_TOKENS:
            context = self._own_context(len(tokens))
            rows, state = elsewhere.prefill(tokens, wanted, context.n_seq, self.seq)
            context.load_state(state, self.seq)
            self._length = len(tokens)
        else:
            rows = self._run(tokens, wanted)
        logits = torch.from_numpy(np.stack(rows))[None]  # [1, rows, n_vocab]
        return logits[..., : self.vocab_size]

    def _run(self, tokens: list[int], wanted: list[bool]) -> list[np.ndarray]:
        """Evaluate tokens after this sequence's cached ones, in passes of at most BATCH -> the wanted logits rows."""
        context = self._own_context(self._length + len(tokens))
        rows = []
        for start in range(0, len(tokens), BATCH):
            rows += self._decode(context, tokens[start:start + BATCH], wanted[start:start + BATCH])
        return rows

    def _decode(self, context: _Context, tokens: list[int], wanted: list[bool]) -> list[np.ndarray]:
        rows = _evaluate(self.model, context, [(self.seq, self._length + i, token, want)
                                               for i, (token, want) in enumerate(zip(tokens, wanted))])
        self._length += len(tokens)
        return rows

    def _own_context(self, needed: int) -> _Context:
        if self._private or self._slots is not None:
            if not self.context.ctx or (self._slots is not None and not self._release.alive):
                raise RuntimeError("this runner was closed; start a new one")
            if needed > self.context.size:
                raise ValueError(f"{needed} tokens exceed this runner's context of {self.context.size} tokens")
            return self.context
        context = self.model._context
        if context is None or context.owner is not self:
            raise RuntimeError("another sequence took over this model's llama.cpp context; start a new runner")
        if needed > self.max_length:
            raise ValueError(f"{needed} tokens exceed the model's context length of {self.max_length}")
        if needed > context.size:
            context = self.model._grow(needed)
        self.context = context
        return context

    def rollback(self, length: int) -> None:
        if length < self._length:
            context = self._own_context(length)
            if not context.lib.llama_memory_seq_rm(context.memory, self.seq, length, -1):
                raise RuntimeError(f"llama.cpp could not remove cache entries past position {length}")
            self._length = length
