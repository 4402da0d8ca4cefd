"""Loading causal LMs (already-loaded model, local directory, .gguf file or registry name) and vocabulary checks."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel


class IncompatibleVocabulary(ValueError):
    """Target and drafter do not share a vocabulary, so q and p would not be over the same tokens."""


def resolve_model_dir(spec: str | Path) -> Path:
    """A registry name, a .gguf file or a transformers directory -> a local transformers directory."""
    from specdec import registry  # imported here: loading an in-memory model needs no registry

    text = str(spec)
    if text in registry.MODELS:
        return registry.local_model_dir(text)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return registry.cached_dir_for_gguf(path)
    if path.is_dir():
        return path
    raise ValueError(f"unknown model {text!r}: give a registry name ({', '.join(registry.MODELS)}), "
                     "a local transformers model directory, or a .gguf file (see `specdec models list`)")


def quantize_int8(model):
    """Swap every nn.Linear (LM head included) for an int8 dynamically quantized one, in place.

    Measured on a 2-core AVX2 CPU, one 1536x8960 layer: fp32 takes 3.4 ms for 1 row and 10.7 ms for 4, int8 0.52 ms
    and 0.74 ms. Activations are quantized with one scale per pass, so rows of a pass are not independent (see
    TorchRunner.max_verify_width). torch.ao's dynamic quantization is deprecated in favour of torchao, whose CPU path
    needs a newer torch than the pinned 2.13.
    """
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


QUANTIZATIONS = {"int8": quantize_int8}  # name -> in-place transform of a model that specdec loaded itself


def load_causal_lm(spec, tokenizer=None, dtype: torch.dtype = torch.float32, quantization: str | None = None):
    """-> (model, tokenizer or None). An already-loaded model is returned as is: shared, never copied.

    quantization: None (weights as loaded) or a name in QUANTIZATIONS, applied to a model loaded here.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: choose from {', '.join(QUANTIZATIONS)}")
    if isinstance(spec, PreTrainedModel):
        if quantization is not None:
            raise ValueError("quantization applies to models that specdec loads; quantize a model you pass in yourself")
        return spec, tokenizer
    directory = resolve_model_dir(spec)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    model.eval()
    if quantization is not None:
        QUANTIZATIONS[quantization](model)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


RUNTIMES = ("torch", "llama.cpp")


def pick_runtime(requested: str, spec) -> str:
    """"auto" -> llama.cpp for a model it can read (registry name, .gguf file, loaded GGUF model) when it is
    installed (faster on a CPU: see BENCHMARKS.md), else torch; an explicit name is checked and returned."""
    if requested in RUNTIMES:
        return requested
    if requested != "auto":
        raise ValueError(f"unknown runtime {requested!r}: choose auto, {' or '.join(RUNTIMES)}")
    if runtime_of(spec) == "llama.cpp":
        return "llama.cpp"
    if isinstance(spec, PreTrainedModel):
        return "torch"
    from specdec import registry
    from specdec.llamacpp import installed

    readable = str(spec) in registry.MODELS or str(spec).endswith(".gguf")
    return "llama.cpp" if readable and installed() else "torch"


def runtime_of(model) -> str:
    """The runtime a loaded model runs on ("torch" for transformers models)."""
    return getattr(model, "runtime", "torch")


def load_model(spec, tokenizer=None, *, runtime: str = "torch", dtype: torch.dtype = torch.float32,
               quantization: str | None = None, threads: int | None = None):
    """-> (model, tokenizer) on the given runtime: a transformers model (torch) or a LlamaCppModel (llama.cpp)."""
    if runtime == "llama.cpp":
        if quantization is not None:
            raise ValueError("the llama.cpp runtime runs the GGUF file's own quantized weights; quantization "
                             "options apply to the torch runtime")
        from specdec import llamacpp

        return llamacpp.load(spec, tokenizer, threads)
    if runtime != "torch":
        raise ValueError(f"unknown runtime {runtime!r}: choose {' or '.join(RUNTIMES)}")
    if threads:
        torch.set_num_threads(threads)
    return load_causal_lm(spec, tokenizer, dtype, quantization)


def model_vocab_size(model) -> int:
    if runtime_of(model) != "torch":
        return model.n_vocab
    return model.get_output_embeddings().out_features  # also defined on quantized linear layers


def shared_vocab_size(target, target_tokenizer, draft, draft_tokenizer) -> int:
    """The number of token ids that target and drafter both mean the same thing by.

    Output layers padded beyond the tokenizer (common in the Qwen family) are fine: only the tokenizer's range is used.
    """
    if target_tokenizer is not None and draft_tokenizer is not None:
        target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            by_id_t = {i: t for t, i in target_vocab.items()}
            by_id_d = {i: t for t, i in draft_vocab.items()}
            first = next(i for i in range(max(len(by_id_t), len(by_id_d)) + 1) if by_id_t.get(i) != by_id_d.get(i))
            raise IncompatibleVocabulary(
                f"target and draft tokenizers differ (target {len(target_vocab)} tokens, draft {len(draft_vocab)}); "
                f"first difference at id {first}: target {by_id_t.get(first)!r} vs draft {by_id_d.get(first)!r}. "
                "Use a draft model of the same family as the target.")
    elif model_vocab_size(target) != model_vocab_size(draft):
        raise IncompatibleVocabulary(
            f"target vocabulary has {model_vocab_size(target)} tokens, draft has {model_vocab_size(draft)}; "
            "without tokenizers to compare, the output layers must be the same size")
    return min(own_vocab_size(target, target_tokenizer), own_vocab_size(draft, draft_tokenizer))


def own_vocab_size(model, tokenizer) -> int:
    """The usable vocabulary of one model: its tokenizer's range (capped by its output layer), or its output layer."""
    rows = model_vocab_size(model)
    return min(len(tokenizer), rows) if tokenizer is not None else rows
