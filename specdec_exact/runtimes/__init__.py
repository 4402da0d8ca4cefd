"""The runtimes a model runs on, behind one protocol: how a model is loaded and what its runtime can do.

torch       transformers models (fp32 or bf16 weights, optionally specdec's int8 layers: models.QUANTIZATIONS)
llama.cpp   GGUF files on llama.cpp's CPU kernels (runtimes.llamacpp; needs llama-cpp-python, built by `make setup`)

A generator holds its Runtime (`gen.runtime`), a loaded model's is `runtime_of(model)`; code that depends on the
runtime asks it (`runtime.early_exit`, `runtime.pool(model)`, `runtime.costs(model)`: runtimes.base) rather than
comparing names or probing the model's attributes.
"""

from __future__ import annotations

from specdec_exact.runtimes.base import Batching, PassCosts, Runner, Runtime, SequencePool
from specdec_exact.runtimes.llamacpp import LLAMA_CPP
from specdec_exact.runtimes.pytorch import TorchRuntime

__all__ = ["LLAMA_CPP", "RUNTIMES", "TORCH", "Batching", "PassCosts", "Runner", "Runtime", "SequencePool",
           "get_runtime", "pick_runtime", "runtime_of"]


TORCH = TorchRuntime()
RUNTIMES: dict[str, Runtime] = {runtime.name: runtime for runtime in (TORCH, LLAMA_CPP)}


def get_runtime(runtime: str | Runtime) -> Runtime:
    """A runtime by name (or itself)."""
    if isinstance(runtime, Runtime):
        return runtime
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}: choose {' or '.join(RUNTIMES)}")
    return RUNTIMES[runtime]


def runtime_of(model) -> Runtime:
    """The runtime a loaded model runs on (TORCH for transformers models and anything no runtime owns)."""
    return LLAMA_CPP if LLAMA_CPP.owns(model) else TORCH


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
