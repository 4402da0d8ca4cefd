"""llama-cpp-python's own generation loop (plain llama.cpp, as its users run it), in a worker process of its own: the
baseline of `specdec-exact bench` and `specdec-exact generate --compare` on the llama.cpp runtime.

With llama.cpp's default weight layouts (repacked for the CPU, AMX tiles where the CPU has them) `Llama.generate`
crashed with a segmentation fault on an Intel Xeon with AMX, taking the whole benchmark down. In a worker process a
crash only ends the worker: the peer then starts a new one with the repacked layouts off (which works there; specdec's
own runtime times the layouts in a worker too, and a crash there means off) and says so in the report.

The worker runs llama.cpp's own kernels: the library specdec installs carries its kernel patch (native/), which the
worker switches off (GGML_CPU_MULTI_COLUMN=0), so the baseline is llama.cpp as released.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys


class PeerCrashed(RuntimeError):
    """The worker process died (a signal or an exit) while it loaded the model or generated."""


def plain_settings(model) -> dict:
    """llama.cpp's defaults for a LlamaCppModel's file, on its thread count: what a llama.cpp user runs."""
    return dict(n_threads=model.threads, n_threads_batch=model.threads, n_batch=512)


class LlamaCppPythonPeer:
    """Greedy generation by `llama_cpp.Llama.generate` in a worker process; one model file, contexts grown on demand.

    settings: `llama_cpp.Llama` keyword arguments (threads, flash attention, cache types...); `lookup_tokens` turns on
    its prompt-lookup speculation.
    """

    def __init__(self, model_path: str, settings: dict, lookup_tokens: int | None = None, repack: bool = True,
                 attention_split: bool = True):
        """repack: llama.cpp's default weight layouts (True) or, as specdec's runtime loads them, not (False).
        attention_split: one-token passes over an f16 cache of 512+ cells split attention across threads as released
        (True) or, as specdec's runtime runs them, not (False; specdec's patch)."""
        self.model_path, self.settings, self.lookup_tokens = model_path, settings, lookup_tokens
        self.attention_split = attention_split
        self.repack = repack  # turned off after a crash
        self.crash: str | None = None  # what the default layouts did, for the report
        self._process = self._connection = None

    @property
    def loaded_as(self) -> str:
        if self.crash is not None:
            return f"repacked weight layouts off: with llama.cpp's defaults its worker {self.crash} on this CPU"
        if not self.repack:
            return "repacked weight layouts off, as specdec's runtime loads weights"
        return "llama.cpp defaults and its own kernels (repacked weight layouts where the CPU has them)"

    def generate(self, prompt: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> list[int]:
        """New tokens, cut before the first end-of-sequence token. A crash with the default layouts is retried once
        with them off; a second crash raises PeerCrashed."""
        try:
            return self._ask(prompt, max_new_tokens, eos_ids)
        except PeerCrashed as crash:
            if not self.repack:
                raise
            self.repack, self.crash = False, str(crash)
            return self._ask(prompt, max_new_tokens, eos_ids)

    def _ask(self, prompt, max_new_tokens, eos_ids) -> list[int]:
        if self._process is None:
            self._start()
        try:
            self._connection.send((prompt, max_new_tokens, sorted(eos_ids)))
            status, value = self._connection.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise PeerCrashed(self._reap()) from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def _start(self) -> None:
        spawn = multiprocessing.get_context("spawn")  # no fork: the parent holds torch's and llama.cpp's threads
        self._connection, child = spawn.Pipe()
        self._process = spawn.Process(target=_serve, name="llama-cpp-python-peer", daemon=True,
                                      args=(child, self.model_path, self.settings, self.lookup_tokens, self.repack,
                                            self.attention_split))
        self._process.start()
        child.close()

    def _reap(self) -> str:
        """Wait for the dead worker -> how it ended, e.g. "died of SIGSEGV"."""
        self._process.join(timeout=10)
        code = self._process.exitcode
        self._process = self._connection = None
        if code is not None and code < 0:
            return f"died of {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def close(self) -> None:
        if self._process is not None:
            try:
                self._connection.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
            self._process = self._connection = None


def _serve(connection, model_path: str, settings: dict, lookup_tokens: int | None, repack: bool,
           attention_split: bool) -> None:
    """The worker: answer (prompt, max_new_tokens, eos_ids) with ("ok", tokens) or ("error", message) until None."""
    import os

    os.environ["GGML_CPU_MULTI_COLUMN"] = "0"  # llama.cpp's own kernels; read when the first pass runs
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if not attention_split:
        from specdec_exact.runtimes.llamacpp.kernels import apply_attention_split

        apply_attention_split(False)

    if not repack:
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def no_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_cpp.llama_model_default_params = no_repack  # this process only exists to run this peer
    llama = None
    while (request := connection.recv()) is not None:
        prompt, max_new_tokens, eos_ids = request
        try:
            needed = len(prompt) + max_new_tokens + (lookup_tokens or 0) + 1
            if llama is None or llama.n_ctx() < needed:
                draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
                # Its speculation reads the logits of every position, so it keeps them all (n_ctx x vocab floats).
                llama = llama_cpp.Llama(model_path, n_ctx=max(needed, 1024), n_gpu_layers=0, draft_model=draft,
                                        logits_all=draft is not None, verbose=False, **settings)
            llama.reset()  # evaluate every prompt from scratch, as a new user would: no prefix reused from the last
            new = []
            for token in llama.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                if token in eos_ids:
                    break
                new.append(token)
                if len(new) >= max_new_tokens:
                    break
            connection.send(("ok", new))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which records it
            connection.send(("error", f"{type(error).__name__}: {error}"))
    sys.exit(0)
