"""The llama.cpp runtime: GGUF weights evaluated by llama.cpp's CPU kernels, behind the same Runner interface.

Only evaluation and the KV cache live in llama.cpp (through llama-cpp-python's bindings of its C API); drafting,
sampling and verification stay in specdec's own code, so exactness is decided in one place for every runtime.

A LlamaCppModel is the memory-mapped weights plus one llama.cpp context (one KV cache). A runner claims the context
for one sequence; starting another runner on the same model hands the context over, and the old runner refuses to
run rather than read a cache that is no longer its own.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from pathlib import Path

import numpy as np
import torch

PIN = "llama-cpp-python==0.3.36"
INITIAL_CONTEXT = 2048  # tokens of KV cache allocated up front; grows by doubling (28 KB per token on the 1.5B)
BATCH = 512  # tokens per llama_decode call (a longer prompt is fed in several)


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


def load(spec, tokenizer=None, threads: int | None = None) -> tuple[LlamaCppModel, object]:
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
        model = LlamaCppModel(path, threads)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(registry.gguf_tokenizer_dir(model.path), local_files_only=True)
    return model, tokenizer


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LlamaCppModel:
    """A GGUF model loaded by llama.cpp: weights memory-mapped (shared by every runner), one context at a time."""

    runtime = "llama.cpp"

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        lib = _lib()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        # No repacked weight layouts: measured on the 2-core AVX2 CPU with Qwen2.5-Coder-1.5B Q4_K_M, the repacked
        # kernels were no faster (64 vs 56 ms a token, 5.6 vs 4.2 s for a 200-token prompt) and change the logits
        # of a pass from 4 tokens up, where the plain kernels stay bitwise equal to one-token passes up to 7.
        params.use_extra_bufts = False
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}: not a GGUF language model it supports")
        self._live_context = [None]  # what the finalizer frees with the model: the current context
        weakref.finalize(self, _free, lib, self._model, self._live_context)
        if lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model):
            raise ValueError(f"{self.path.name} has recurrent layers, whose state cannot be rolled back; "
                             "speculative decoding needs full attention in every layer")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.max_length = lib.llama_model_n_ctx_train(self._model)
        self.eos_ids = frozenset(i for i in range(self.n_vocab) if lib.llama_vocab_is_eog(self._vocab, i))
        self._context: _Context | None = None
        self._calibration: dict | None = None

    @property
    def calibration(self) -> dict:
        """{"exact_width": w, "pass_s": {width: seconds}}, measured once per model file, llama.cpp build and CPU,
        then read from the cache (see calibrate)."""
        if self._calibration is None:
            self._calibration = _cached_calibration(self)
        return self._calibration

    @property
    def exact_width(self) -> int:
        """The widest pass whose logits equal, bit for bit, one-token passes over the same tokens (>= 1).

        llama.cpp picks kernels by the number of tokens in a pass, and they round differently; a verify pass wider
        than this could flip a near-tie that plain decoding would not, so the engine drafts at most this - 1 tokens.
        """
        return self.calibration["exact_width"]

    @property
    def verify_slope(self) -> float:
        """Extra seconds per extra token of a pass, relative to a one-token pass (0: flat, 1: linear)."""
        pass_s = {int(w): s for w, s in self.calibration["pass_s"].items()}
        slopes = sorted((s / pass_s[1] - 1) / (w - 1) for w, s in pass_s.items() if w > 1)
        return max(0.0, slopes[len(slopes) // 2]) if slopes else 0.0

    @property
    def step_s(self) -> float:
        """Seconds of one one-token pass (at the calibration's short context)."""
        return self.calibration["pass_s"]["1"]

    def new_runner(self, vocab_size: int) -> LlamaCppRunner:
        return LlamaCppRunner(self, vocab_size)

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

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}, threads={self.threads})"


CALIBRATION_WIDTHS = range(2, 9)  # verify widths checked: up to 7 draft tokens
CALIBRATION_PREFIX = 16  # tokens in the cache before the checked passes


def _cached_calibration(model: LlamaCppModel) -> dict:
    import hashlib
    import json
    from importlib.metadata import version

    from specdec import registry

    stat = model.path.stat()
    cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "") if os.path.exists(
        "/proc/cpuinfo") else os.uname().machine
    key = hashlib.sha256(f"{model.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version('llama_cpp_python')}|"
                         f"{cpu}|{model.threads}".encode()).hexdigest()[:24]
    path = registry.cache_root() / "calibration" / f"{model.path.stem}-{key}.json"
    try:
        found = json.loads(path.read_text())
        if {"exact_width", "pass_s"} <= set(found):
            return {"exact_width": found["exact_width"], "pass_s": found["pass_s"]}
    except (OSError, ValueError):
        pass
    found = calibrate(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"model": str(model.path), "threads": model.threads, **found}) + "\n")
    partial.replace(path)
    return found


def calibrate(model: LlamaCppModel, widths=CALIBRATION_WIDTHS) -> dict:
    """Evaluate the same tokens one at a time and in passes of 2..8 tokens ->
    {"exact_width": the largest w such that every pass of 2..w tokens gives the one-token logits bit for bit (1 if
    none does), "pass_s": {width: seconds of that pass}} (a prior for k="auto"). It evaluates 59 tokens in 16 passes."""
    import statistics
    import time

    vocab = model.n_vocab
    tokens = torch.arange(CALIBRATION_PREFIX + max(widths))[None] * 7919 % vocab  # any in-vocabulary tokens
    runner = LlamaCppRunner(model, vocab, max_verify_width=1)
    runner.forward(tokens[:, :CALIBRATION_PREFIX], last_only=True)
    single, single_s = [], []
    for i in range(CALIBRATION_PREFIX, tokens.shape[1]):
        started = time.perf_counter()
        single.append(runner.forward(tokens[:, i:i + 1])[0])
        single_s.append(time.perf_counter() - started)
    single = torch.cat(single)
    exact, pass_s = 1, {"1": statistics.median(single_s)}
    for width in widths:
        runner.rollback(CALIBRATION_PREFIX)
        started = time.perf_counter()
        logits = runner.forward(tokens[:, CALIBRATION_PREFIX:CALIBRATION_PREFIX + width])[0]
        pass_s[str(width)] = time.perf_counter() - started
        if exact == width - 1 and torch.equal(logits, single[:width]):
            exact = width
    runner.rollback(0)
    return {"exact_width": exact, "pass_s": pass_s}


def _free(lib, model, context_box) -> None:
    if context_box[0] is not None:
        context_box[0].free()
    lib.llama_model_free(model)


class _Context:
    """One llama.cpp context (KV cache for one sequence, id 0) and a reusable batch."""

    def __init__(self, model: LlamaCppModel, size: int):
        lib = self.lib = _lib()
        params = lib.llama_context_default_params()
        params.n_ctx = size
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = model.threads
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(model._model, params)
        if not self.ctx:
            raise MemoryError(f"llama.cpp could not allocate a context of {size} tokens for {model.path.name}")
        self.size = lib.llama_n_ctx(self.ctx)
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(BATCH, 0, 1)
        self.owner = None

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def save_state(self) -> bytes:
        size = self.lib.llama_state_seq_get_size(self.ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(self.ctx, buffer, size, 0)
        return bytes(buffer[:written])

    def load_state(self, state: bytes) -> None:
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if self.lib.llama_state_seq_set_data(self.ctx, buffer, len(state), 0) != len(state):
            raise RuntimeError("llama.cpp could not restore a sequence into a bigger context")

    def free(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


class LlamaCppRunner:
    """One sequence on a LlamaCppModel: forward over new tokens (logits of each, or the last), roll back."""

    def __init__(self, model: LlamaCppModel, vocab_size: int, max_verify_width: int | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.max_length = model.max_length
        # Read by the engine. Calibrated (on first use of the model) before this runner claims the context.
        self.max_verify_width = max_verify_width or model.exact_width
        self.context = model._claim(self)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError("the llama.cpp runtime runs one sequence at a time (batch size 1)")
        tokens = input_ids[0].tolist()
        if not tokens:
            raise ValueError("forward needs at least one token")
        context = self._own_context(self._length + len(tokens))
        rows = []
        for start in range(0, len(tokens), BATCH):
            chunk = tokens[start:start + BATCH]
            is_last_chunk = start + BATCH >= len(tokens)
            wanted = [False] * len(chunk) if not is_last_chunk else (
                [False] * (len(chunk) - 1) + [True] if last_only else [True] * len(chunk))
            rows += self._decode(context, chunk, wanted)
        logits = torch.from_numpy(np.stack(rows))[None]  # [1, rows, n_vocab]
        return logits[..., : self.vocab_size]

    def _decode(self, context: _Context, tokens: list[int], wanted: list[bool]) -> list[np.ndarray]:
        lib, batch = context.lib, context.batch
        for i, (token, want) in enumerate(zip(tokens, wanted)):
            batch.token[i] = token
            batch.pos[i] = self._length + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = want
        batch.n_tokens = len(tokens)
        status = lib.llama_decode(context.ctx, batch)
        if status != 0:
            # The cache may hold part of the batch now; cut it back so the runner stays consistent.
            lib.llama_memory_seq_rm(context.memory, 0, self._length, -1)
            raise RuntimeError(f"llama.cpp failed to evaluate {len(tokens)} tokens (llama_decode returned {status})")
        self._length += len(tokens)
        n_vocab = self.model.n_vocab
        return [np.ctypeslib.as_array(lib.llama_get_logits_ith(context.ctx, i), shape=(n_vocab,)).copy()
                for i, want in enumerate(wanted) if want]

    def _own_context(self, needed: int) -> _Context:
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
            if not context.lib.llama_memory_seq_rm(context.memory, 0, length, -1):
                raise RuntimeError(f"llama.cpp could not remove cache entries past position {length}")
            self._length = length
