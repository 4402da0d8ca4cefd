"""The llama.cpp runtime: GGUF weights evaluated by llama.cpp's CPU kernels, behind the same runner interface.

Only evaluation and the KV cache live in llama.cpp (through llama-cpp-python's bindings of its C API); drafting,
sampling and verification stay in specdec's own code, so exactness is decided in one place for every runtime.

library.py      loading llama.cpp (llama-cpp-python), once
model.py        LlamaCppModel: the weights, their calibrations, their slot pools
context.py      contexts (KV caches), one pass (evaluate), SlotPool: the sequence slots of one context
runner.py       LlamaCppRunner: one sequence in a slot; its prompt prefilled through the prompt cache
kv_blocks.py    a sequence's KV cache cut into the prompt cache's blocks, and put back together
kernels.py      the kernel plan: which CPU kernels take passes of each width, chosen on this machine
calibration.py  what is measured once per model file and machine: pass costs, exact widths, batch shapes
layouts.py      which weight layout (plain or repacked) runs faster on this CPU
peer.py         llama-cpp-python's own generation loop, the plain baseline
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_exact.runtimes.base import Batching, PassCosts, Runtime
from specdec_exact.runtimes.llamacpp.calibration import (CALIBRATION_CONTEXTS, CALIBRATION_WIDTHS, DEFAULT_SLOT_TOKENS,
                                                         batch_mixes, measure_batch_width, measure_exact_widths,
                                                         one_token_logits, private_runner, probe_tokens)
from specdec_exact.runtimes.llamacpp.context import BATCH, DEFAULT_KV_CACHE, KV_CACHE_TYPES, PREFILL_BLOCK, SlotPool
from specdec_exact.runtimes.llamacpp.layouts import choose_layouts
from specdec_exact.runtimes.llamacpp.library import PIN, LlamaCppUnavailable, installed
from specdec_exact.runtimes.llamacpp.model import LlamaCppModel
from specdec_exact.runtimes.llamacpp.runner import PREFILL_MIN_TOKENS, LlamaCppRunner

__all__ = ["BATCH", "CALIBRATION_CONTEXTS", "CALIBRATION_WIDTHS", "DEFAULT_KV_CACHE", "DEFAULT_SLOT_TOKENS",
           "KV_CACHE_TYPES", "LLAMA_CPP", "PIN", "PREFILL_BLOCK", "PREFILL_MIN_TOKENS", "LlamaCppModel", "LlamaCppRunner",
           "LlamaCppRuntime", "LlamaCppUnavailable", "SlotPool", "batch_mixes", "choose_layouts", "installed", "load",
           "measure_batch_width", "measure_exact_widths", "one_token_logits",
           "private_runner", "probe_tokens"]


def load(spec, tokenizer=None, threads: int | None = None, kv_cache: str = DEFAULT_KV_CACHE):
    """A registry name, a .gguf file or a loaded LlamaCppModel -> (model, transformers tokenizer read from the GGUF)."""
    from specdec_exact import registry

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
        tokenizer = read_tokenizer(registry.gguf_tokenizer_dir(model.path))
    return model, tokenizer


# Tokenizers read in this process, by the content of their files but the chat template: a draft model of the target's
# family (the same vocabulary files, another chat template) takes a copy of the target's, with its own template, rather
# than parsing the same files again (0.8 s for Qwen2.5's 7 MB tokenizer.json)
_TOKENIZERS: dict[str, object] = {}
CHAT_TEMPLATE = "chat_template.jinja"


def vocabulary_key(directory: Path) -> str:
    """A digest of the tokenizer files saved in `directory` but its chat template: the same for two GGUF files whose
    tokenizers differ in their chat templates alone (a model family's sizes)."""
    import hashlib

    from specdec_exact.registry.cache import MARKER

    digest = hashlib.sha256()
    for path in sorted(path for path in directory.iterdir() if path.is_file() and path.name not in (MARKER,
                                                                                                      CHAT_TEMPLATE)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def read_tokenizer(directory: Path):
    """The transformers tokenizer saved in `directory` (registry.gguf_tokenizer_dir)."""
    import copy

    from transformers import AutoTokenizer

    template = directory / CHAT_TEMPLATE
    key = f"{vocabulary_key(directory)}|{template.is_file()}"  # (without a template file, the config holds it)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        return _TOKENIZERS[key]
    tokenizer = copy.copy(_TOKENIZERS[key])
    if template.is_file():
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    return tokenizer


class LlamaCppRuntime(Runtime):
    name = "llama.cpp"
    peers = {"llama-server": "upstream llama-server, unpatched, over HTTP (make llama-server)",
             "llama-generate": "llama-cpp-python's own generation loop",
             "llama-lookup": "llama-cpp-python's prompt-lookup speculation"}
    baseline_peer = "llama-generate"
    caches_prompts = True

    def installed(self) -> bool:
        return installed()

    def owns(self, model) -> bool:
        return isinstance(model, LlamaCppModel)

    def reads(self, spec) -> bool:
        from specdec_exact import registry

        return self.owns(spec) or str(spec) in registry.MODELS or str(spec).endswith(".gguf")

    def load(self, spec, tokenizer=None, *, dtype=torch.float32, quantization=None, threads=None):
        if quantization is not None:
            raise ValueError("the llama.cpp runtime runs the GGUF file's own quantized weights; quantization "
                             "options apply to the torch runtime")
        return load(spec, tokenizer, threads)

    def pull(self, name, progress=True):
        from specdec_exact import registry

        return registry.gguf_file(name, progress=progress)

    def vocab_size(self, model) -> int:
        return model.n_vocab

    def context_length(self, model) -> int:
        return model.max_length  # (no check_rollback: llama.cpp's caches of the models it loads roll back)

    def kv_bytes_per_token(self, model) -> int:
        return model.kv_bytes_per_token

    def eos_ids(self, model) -> frozenset[int]:
        return model.eos_ids

    def prepare(self, model) -> None:
        model.prepare()

    def prepare_as_target(self, model) -> None:
        model.prepare_as_target()

    def pool(self, model, sequences=1, max_length=None, prompt_cache=None):
        return model.pool(sequences, max_length, prompt_cache)

    def own_pool(self, model, max_length=None, prompt_cache=None):
        return model.own_pool(max_length, prompt_cache)

    def costs(self, model) -> PassCosts:
        return model.costs

    def step_estimate(self, model) -> float:
        return model.quick_step_s()

    def known_step_estimate(self, spec, target, threads: int | None = None) -> float | None:
        from specdec_exact import registry
        from specdec_exact.runtimes.llamacpp.calibration import peek_json, step_settings
        from specdec_exact.runtimes.llamacpp.library import default_threads

        if not isinstance(spec, (str, Path)) or not isinstance(target, LlamaCppModel):
            return None
        text = str(spec)
        if text in registry.MODELS:
            path = registry.gguf_file(text)
        elif text.endswith(".gguf") and Path(text).expanduser().is_file():
            path = Path(text).expanduser()
        else:
            return None
        # Only a draft with the target's vocabulary is judged by its step (one with another drafts through a mapping
        # of tokens, drafters.cross_vocab, and is not judged so): the same tokenizer files, but the chat template
        if len({vocabulary_key(registry.gguf_tokenizer_dir(gguf)) for gguf in (path, target.path)}) > 1:
            return None
        found = peek_json(path, "step", step_settings(threads or default_threads(), DEFAULT_KV_CACHE))
        return None if found is None else found["seconds"]

    def batching(self, model) -> Batching:
        return Batching(model.batch_width, model.prefills_in_slots_exactly, model.fused_pass_cost)

    def kernel_plan(self, model) -> str:
        return model.kernel_plan.describe()


    def describe(self, model) -> dict:
        return {"class": type(model).__name__, "file": str(model.path), "file_bytes": model.path.stat().st_size,
                "threads": model.threads, "kv_cache": model.kv_cache, "repacked_layouts": model.repack,
                "prompts_repacked": model.repack if model.prefill_model is None else model.prefill_model.repack}


LLAMA_CPP = LlamaCppRuntime()
