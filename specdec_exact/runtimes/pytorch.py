"""The torch runtime: transformers causal LMs (fp32 or bf16 weights, optionally specdec's int8 layers:
models.QUANTIZATIONS), each sequence a runner with a DynamicCache of its own."""

from __future__ import annotations

import copy
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from specdec_exact import progress
from specdec_exact.runtimes.base import Runner, Runtime, pass_starts


class RollbackUnsupported(ValueError):
    """The model's cache cannot be trimmed, so rejected draft tokens could not be undone."""


def context_length(config) -> int:
    text_config = config.get_text_config(decoder=True)
    return int(getattr(text_config, "max_position_embeddings", None) or 2**31)


def check_rollback_supported(model) -> None:
    """Refuse up front a model whose KV cache cannot be cut back to an arbitrary length.

    Sliding-window and linear-attention layers drop or fold past states; rolling them back needs states they no
    longer hold, so speculation over them would silently corrupt the context.
    """
    cache = DynamicCache(config=model.config)
    unsupported = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if unsupported:
        raise RollbackUnsupported(
            f"{type(model).__name__} uses cache layers that cannot be rolled back ({', '.join(unsupported)}); "
            "speculative decoding needs a model with full attention in every layer.")


def has_dynamic_quantization(model) -> bool:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return any(isinstance(module, DynamicQuantizedLinear) for module in model.modules())


class TorchRunner:
    """A transformers causal LM (shared, never copied) plus this sequence's own DynamicCache."""

    prompt_tokens_reused, prompt_cache_s = 0, 0.0  # the torch runtime has no prompt cache: every prompt is prefilled

    def __init__(self, model, vocab_size: int, max_length: int | None = None, pool: TorchPool | None = None):
        self.model, self.pool = model, pool
        self.vocab_size = vocab_size
        self.max_length = min(max_length or context_length(model.config), context_length(model.config))
        self.cache = DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        pass_starts()
        # logits_to_keep=1 skips the LM head (vocab x hidden per row) for positions nobody reads.
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        return out.logits[..., : self.vocab_size].float()

    def verify_width(self, length: int) -> int:
        return exact_verify_width(self.model).at(length)

    def rollback(self, length: int) -> None:
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)

    def close(self) -> None:
        self.cache = DynamicCache(config=self.model.config)


CALIBRATION_WIDTHS = range(2, 17)  # verify passes checked: the newest committed token and up to 15 draft tokens
# Cached tokens before the checked passes: a short prompt; past 512 keys, where torch's CPU flash attention starts
# taking the keys in blocks of 512; a long prompt (a few pages) whose passes cross a block edge (2048 keys).
CALIBRATION_CONTEXTS = (16, 600, 2040)


@dataclass(frozen=True)
class ExactWidth:
    """What the calibration of one model found (measure_exact_width)."""

    width: int  # the widest verify pass exact at every context checked (1: no pass wider than one token)
    longest_context: int  # cached tokens before the longest context's passes; nothing beyond it was checked

    def at(self, length: int) -> int:
        """The widest pass the engine may verify after `length` cached tokens: one token beyond the contexts
        checked."""
        return self.width if length <= self.longest_context else 1


_calibrated: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {kernel settings: ExactWidth}


def exact_verify_width(model) -> ExactWidth:
    """How wide a verify pass over model may be for its logits to equal one-token passes bit for bit.

    torch's matrix products and attention may take other paths for several rows than for one, which round
    differently, so no width is assumed: it is measured (measure_exact_width) once per model object, and again if
    torch's thread count, the model's dtype or its attention implementation changes, since kernels choose by those.
    Only the loaded object is remembered, not a file: each process measures its target once.

    torch's dynamically quantized layers scale a pass's activations by the largest of all its tokens, so a token's
    logits depend on the tokens verified beside it: such a model verifies one token at a time, unmeasured.
    """
    settings = (torch.get_num_threads(), model.dtype, getattr(model.config, "_attn_implementation", None))
    found = _calibrated.setdefault(model, {})
    if settings not in found:
        found[settings] = ExactWidth(1, 0) if has_dynamic_quantization(model) else measure_exact_width(model)
    return found[settings]


def measure_exact_width(model, widths=CALIBRATION_WIDTHS, contexts=CALIBRATION_CONTEXTS) -> ExactWidth:
    """The widest w such that at each context length in contexts (capped by the model's), passes of every width
    2..w over probe tokens give the logits of one-token passes over the same tokens bit for bit (1 if none does).

    Only the shortest context is prefilled; each longer one is the cache entries before it repeated to its length.
    Kernels choose their paths by the shapes of a pass and of its cache, not by the values in them, so the passes
    after it take the paths they take after a real prompt of that length, without a long prefill's cost (specdec's
    int8 target computes a prefill's attention one row at a time).

    Widths are checked in order at each context and the first inexact one ends that context; a later context checks
    only the widths still standing, and a width of 1 ends the calibration. What it costs: a model exact at every
    width runs a 16-token prefill and, per context, 16 one-token passes and one pass of each width 2..16; a model
    inexact at width 2 stops after the prefill, two one-token passes and one two-token pass.

    What it promises: the logits of a verify pass, at the widths and contexts checked, and by extension at the
    lengths between them; beyond the longest context nothing was checked, so ExactWidth.at says one token there. It
    does not compare the cache entries a verify pass writes with those that one-token passes write.
    """
    limit = context_length(model.config)
    widths = [w for w in widths if w < limit]
    if not widths:
        return ExactWidth(1, 0)
    lengths = sorted({max(1, min(n, limit - max(widths))) for n in contexts})
    rows = model.get_output_embeddings().out_features
    sequence = TorchRunner(model, rows)
    sequence.forward(probe_tokens(rows, lengths[0]), last_only=True)
    widest, checked = max(widths), lengths[0]
    for length in progress.each(lengths, f"calibrating {model_name(model)}: exact verify width after N tokens",
                                "context"):
        repeat_cache_to(sequence.cache, length)
        continuation = probe_tokens(rows, length + max(widths))[:, length:]
        exact = exact_pass_widths(sequence, continuation, [w for w in widths if w <= widest], until_inexact=True)
        widest, checked = max(exact, default=1), length  # exact: the widths up to the first inexact one
        if widest == 1:
            break
    sequence.close()
    return ExactWidth(widest, checked)


def repeat_cache_to(cache: DynamicCache, length: int) -> None:
    """Grow every layer of cache to `length` entries by repeating the keys and values it holds."""
    for layer in cache.layers:
        held = layer.keys.shape[-2]
        if held < length:
            copies = -(-length // held)
            layer.update(torch.cat([layer.keys] * copies, dim=-2)[..., held:length, :],
                         torch.cat([layer.values] * copies, dim=-2)[..., held:length, :])


@torch.inference_mode()
def exact_pass_widths(sequence: TorchRunner, continuation: torch.Tensor, widths, until_inexact: bool = False
                      ) -> list[int]:
    """The widths w in widths whose pass over continuation[:, :w], appended to what sequence holds, gives each
    position the logits that one-token passes give it, bit for bit (in order; until_inexact: stop at the first
    inexact width). The one-token passes run in sequence, as far as the widths need; the passes of each width in a
    copy of its cache; sequence is rolled back to where it was."""
    length = sequence.length
    verifying = TorchRunner(sequence.model, sequence.vocab_size)
    verifying.cache = copy.deepcopy(sequence.cache)
    one_token, exact = [], []
    for width in widths:
        while len(one_token) < width:
            one_token.append(sequence.forward(continuation[:, len(one_token):len(one_token) + 1])[0])  # [1, vocab]
        verifying.rollback(length)
        if torch.equal(verifying.forward(continuation[:, :width])[0], torch.cat(one_token[:width])):  # [width, vocab]
            exact.append(width)
        elif until_inexact:
            break
    sequence.rollback(length)
    verifying.close()
    return exact


def probe_tokens(vocab_size: int, n: int) -> torch.Tensor:
    return torch.arange(n)[None] * 7919 % vocab_size  # [1, n] any in-vocabulary tokens, spread over the vocabulary


def model_name(model) -> str:
    return Path(str(getattr(model, "name_or_path", "") or type(model).__name__)).name


class TorchPool:
    """Sequences of a transformers model: as many as asked for, each with a cache of its own; their passes run one
    sequence at a time (a fused pass would pad them to one shape, which rounds differently)."""

    def __init__(self, model, max_length: int | None = None):
        self.model = model
        self.max_length = min(max_length or context_length(model.config), context_length(model.config))

    @property
    def free(self) -> int:
        return sys.maxsize

    def take(self, vocab_size: int, tenant: str | None = None) -> TorchRunner:
        return TorchRunner(self.model, vocab_size, self.max_length, self)  # (no prompt cache: nothing is shared)

    def forward_many(self, items: list[tuple[Runner, torch.Tensor]]) -> list[torch.Tensor]:
        return [runner.forward(tokens) for runner, tokens in items]


class TorchRuntime(Runtime):
    name = "torch"
    early_exit = True
    default_draft_quantization = "int8"
    peers = {"hf-generate": "transformers' generate", "hf-assisted": "transformers' assisted generation",
             "hf-lookup": "transformers' prompt lookup"}

    def owns(self, model) -> bool:
        return isinstance(model, torch.nn.Module)

    def prepare_as_target(self, model) -> None:
        """Calibrate the target's exact verify width now (exact_verify_width), not inside the first request."""
        exact_verify_width(model)

    def reads(self, spec) -> bool:
        # A loaded transformers model means its modeling module is imported: where it is not, no spec can be one,
        # and importing it (a second) only to ask would slow every start of a GGUF model
        modeling = sys.modules.get("transformers.modeling_utils")
        return ((modeling is not None and isinstance(spec, modeling.PreTrainedModel))
                or Path(str(spec)).expanduser().is_dir())

    def load(self, spec, tokenizer=None, *, dtype=torch.float32, quantization=None, threads=None):
        from specdec_exact.models import load_causal_lm

        if threads:
            torch.set_num_threads(threads)
        return load_causal_lm(spec, tokenizer, dtype, quantization)

    def pull(self, name, progress=True):
        from specdec_exact import registry

        return registry.pull(name, progress=progress)

    def vocab_size(self, model) -> int:
        return model.get_output_embeddings().out_features  # also defined on quantized linear layers

    def context_length(self, model) -> int:
        return context_length(model.config)

    def kv_bytes_per_token(self, model) -> int:
        config = model.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        element = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
        return 2 * config.num_hidden_layers * kv_heads * head_dim * element

    def eos_ids(self, model) -> frozenset[int]:
        ids = set()
        for source in (getattr(model, "generation_config", None), model.config):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        return frozenset(ids)

    def check_rollback(self, model) -> None:
        check_rollback_supported(model)

    def pool(self, model, sequences=1, max_length=None, prompt_cache=None) -> TorchPool:
        return TorchPool(model, max_length)

    def describe(self, model) -> dict:
        return {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
                "layers": model.config.get_text_config().num_hidden_layers, "dtype": str(model.dtype)}
