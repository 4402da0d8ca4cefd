"""The runtimes a model runs on, behind one protocol: how a model is loaded and what its runtime can do.

torch       transformers models (fp32 or bf16 weights, optionally specdec's int8 layers: models.QUANTIZATIONS)
llama.cpp   GGUF files on llama.cpp's CPU kernels (specdec.llamacpp; needs llama-cpp-python, built by `make setup`)

A generator holds its Runtime (`gen.runtime`), a loaded model's is `runtime_of(model)`; code that depends on the
runtime asks it (`runtime.early_exit`, `runtime.load(...)`) rather than comparing names. Runners are the other half
of the protocol (specdec.runners.new_runner): a model of any runtime makes its own.
"""

from __future__ import annotations

from pathlib import Path

import torch


class Runtime:
    """What specdec asks of a runtime. One instance per runtime: TORCH, LLAMA_CPP."""

    name: str
    early_exit = False  # a drafter may run the target's first N layers (self:N)
    default_draft_quantization: str | None = None  # what --quantize-draft auto means on it
    peers: dict[str, str] = {}  # the benchmark's peer methods that run on it (other implementations) -> what each is
    # The peer that decodes plainly from the same weights, which every benchmark and `generate --compare` measure as
    # the plain decoder to beat (None: target-only decoding is that baseline)
    baseline_peer: str | None = None

    def installed(self) -> bool:
        return True

    def reads(self, spec) -> bool:
        """Whether it runs spec (a registry name, a path, a loaded model) as it is, with no conversion."""
        raise NotImplementedError

    def load(self, spec, tokenizer=None, *, dtype: torch.dtype = torch.float32, quantization: str | None = None,
             threads: int | None = None):
        """A model given as a registry name, a path or a loaded model -> (model, tokenizer)."""
        raise NotImplementedError

    def pull(self, name: str, progress: bool = True) -> Path:
        """What `specdec models pull NAME --runtime R` prepares for a registry model -> its path."""
        raise NotImplementedError

    def vocab_size(self, model) -> int:
        """Rows of the model's output layer."""
        raise NotImplementedError

    def context_length(self, model) -> int:
        """Tokens one sequence of the model may hold."""
        raise NotImplementedError

    def check_rollback(self, model) -> None:
        """Refuse a model whose cache cannot be cut back to any length (speculation needs it)."""

    def describe(self, model) -> dict:
        """What a benchmark records about a loaded model."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<runtime {self.name}>"


class TorchRuntime(Runtime):
    name = "torch"
    early_exit = True
    default_draft_quantization = "int8"
    peers = {"hf-generate": "transformers' generate", "hf-assisted": "transformers' assisted generation",
             "hf-lookup": "transformers' prompt lookup"}

    def reads(self, spec) -> bool:
        from transformers import PreTrainedModel

        return isinstance(spec, PreTrainedModel) or Path(str(spec)).expanduser().is_dir()

    def load(self, spec, tokenizer=None, *, dtype=torch.float32, quantization=None, threads=None):
        from specdec.models import load_causal_lm

        if threads:
            torch.set_num_threads(threads)
        return load_causal_lm(spec, tokenizer, dtype, quantization)

    def pull(self, name, progress=True):
        from specdec import registry

        return registry.pull(name, progress=progress)

    def vocab_size(self, model) -> int:
        return model.get_output_embeddings().out_features  # also defined on quantized linear layers

    def context_length(self, model) -> int:
        from specdec.runners import context_length

        return context_length(model.config)

    def check_rollback(self, model) -> None:
        from specdec.runners import check_rollback_supported

        check_rollback_supported(model)

    def describe(self, model) -> dict:
        return {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
                "layers": model.config.get_text_config().num_hidden_layers, "dtype": str(model.dtype)}


class LlamaCppRuntime(Runtime):
    name = "llama.cpp"
    peers = {"llama-server": "upstream llama-server, unpatched, over HTTP (make llama-server)",
             "llama-generate": "llama-cpp-python's own generation loop",
             "llama-lookup": "llama-cpp-python's prompt-lookup speculation"}
    baseline_peer = "llama-generate"

    def installed(self) -> bool:
        from specdec import llamacpp

        return llamacpp.installed()

    def reads(self, spec) -> bool:
        from specdec import registry

        return getattr(spec, "runtime", None) is self or str(spec) in registry.MODELS or str(spec).endswith(".gguf")

    def load(self, spec, tokenizer=None, *, dtype=torch.float32, quantization=None, threads=None):
        if quantization is not None:
            raise ValueError("the llama.cpp runtime runs the GGUF file's own quantized weights; quantization "
                             "options apply to the torch runtime")
        from specdec import llamacpp

        return llamacpp.load(spec, tokenizer, threads)

    def pull(self, name, progress=True):
        from specdec import registry

        return registry.gguf_file(name, progress=progress)

    def vocab_size(self, model) -> int:
        return model.n_vocab

    def context_length(self, model) -> int:
        return model.max_length  # (no check_rollback: llama.cpp's caches of the models it loads roll back)

    def describe(self, model) -> dict:
        return {"class": type(model).__name__, "file": str(model.path), "file_bytes": model.path.stat().st_size,
                "threads": model.threads, "kv_cache": model.kv_cache, "repacked_layouts": model.repack,
                "prompts_repacked": model.repack if model.prefill_model is None else model.prefill_model.repack}


TORCH, LLAMA_CPP = TorchRuntime(), LlamaCppRuntime()
RUNTIMES: dict[str, Runtime] = {runtime.name: runtime for runtime in (TORCH, LLAMA_CPP)}


def get_runtime(runtime: str | Runtime) -> Runtime:
    """A runtime by name (or itself)."""
    if isinstance(runtime, Runtime):
        return runtime
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}: choose {' or '.join(RUNTIMES)}")
    return RUNTIMES[runtime]


def runtime_of(model) -> Runtime:
    """The runtime a loaded model runs on (TORCH for transformers models)."""
    return getattr(model, "runtime", TORCH)


def pick_runtime(requested: str | Runtime, spec) -> Runtime:
    """"auto" -> llama.cpp for a model it reads (registry name, .gguf file, loaded GGUF model) when it is installed
    (faster on a CPU: see docs/benchmarks-history.md), else torch; an explicit runtime is checked and returned."""
    if requested != "auto":
        try:
            return get_runtime(requested)
        except ValueError:
            raise ValueError(f"unknown runtime {requested!r}: choose auto, {' or '.join(RUNTIMES)}") from None
    if runtime_of(spec) is not TORCH:
        return runtime_of(spec)
    return LLAMA_CPP if not TORCH.reads(spec) and LLAMA_CPP.reads(spec) and LLAMA_CPP.installed() else TORCH
