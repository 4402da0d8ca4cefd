"""Loading causal LMs (already-loaded model, local directory, .gguf file or registry name) and specdec's int8 layers."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel



def resolve_model_dir(spec: str | Path) -> Path:
    """A registry name, a .gguf file or a transformers directory -> a local transformers directory."""
    from specdec_exact import registry  # imported here: loading an in-memory model needs no registry

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
                     "a local transformers model directory, or a .gguf file (see `specdec-exact models list`)")


class RowwiseInt8Linear(torch.nn.Module):
    """A linear layer with int8 weights (one scale per output channel) whose rows do not interact.

    torch's dynamic int8 linear quantizes a pass's activations with one scale and zero point for all its rows, so a
    token's output depends on the tokens beside it. Here each row is first divided by its own largest magnitude, and a
    guard row holding +1 and -1 joins the pass, so the pass's activation range is always exactly [-1, 1]: every row
    is quantized the same way whatever else is in the pass, the int8 products accumulate exactly in int32, and the
    row's scale is multiplied back afterwards. Output rows are then bit-for-bit independent of the pass (and the
    per-row scale is also more accurate than a per-pass one). Measured on one 1536 -> 8960 layer, 2 AVX2 cores:
    0.65 ms for 1 row, 1.02 ms for 5, 1.35 ms for 8 (fp32: 3.4 ms for one row).
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scales = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated for a future torch; the pinned 2.13 has them
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(),
                                                                         requires_grad=False)
        guard = torch.zeros(1, self.in_features)
        guard[0, 0], guard[0, min(1, self.in_features - 1)] = 1.0, -1.0
        self.register_buffer("_guard", guard, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        out = torch.ops.quantized.linear_dynamic(torch.cat([rows / scale, self._guard]), self._packed, True)
        out = out[:-1] * scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


ROWWISE_ATTENTION = "specdec_rowwise"


def rowwise_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """Causal attention computed query row by query row, each exactly as a one-token pass would compute it.

    For one unpadded sequence whose new tokens are the last query.shape[2] of the keys (how specdec's runners call
    a model). SDPA takes other paths for one query than for several, which round differently; here query row i
    always sees keys[:n_i] through the same operations, so a verify pass reproduces one-token passes bit for bit.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = dim ** -0.5 if scaling is None else scaling
    rows = []
    for i in range(q_len):
        visible = kv_len - q_len + i + 1
        q = query[:, :, i].reshape(batch, kv_heads, groups, dim)
        scores = torch.matmul(q, key[:, :, :visible].transpose(-1, -2)) * scaling  # [batch, kv_heads, groups, n]
        probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        rows.append(torch.matmul(probs, value[:, :, :visible]).reshape(batch, heads, dim))
    return torch.stack(rows, dim=1), None  # [batch, q_len, heads, dim], as transformers' attention functions return


def quantize_int8(model):
    """Swap every nn.Linear (LM head included) for a RowwiseInt8Linear, in place, and compute attention row by row
    (rowwise_attention); -> model.

    int8 weights read a quarter of the bytes and run on the CPU's integer dot-product units (fbgemm): on 2 AVX2
    cores the 1.5B target decodes in ~90 ms a token instead of ~450, and a pass over 5 tokens costs ~1.5x one token
    (fp32: ~3x). The rows of a pass stay independent, so a verify pass gives the logits of one-token passes.
    """
    if getattr(model, "config", None) is not None and hasattr(model, "set_attn_implementation"):
        from transformers import AttentionInterface

        AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
        model.set_attn_implementation(ROWWISE_ATTENTION)
    _swap_linears(model)
    return model


def _swap_linears(model) -> None:
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, RowwiseInt8Linear(child))
        else:
            _swap_linears(child)


def quantize_int8_per_pass(model):
    """torch's dynamic int8 (one activation scale per pass, rows not independent), in place; -> model.

    For draft models, which only propose: measured on the 0.5B draft, its step costs 0.48 of an int8 target step
    against 0.65 with quantize_int8's row-by-row work.
    """
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao's quantization is deprecated for a future torch; 2.13 has it
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


# name -> in-place transform of a model that specdec loaded itself. "int8" keeps rows independent (what a target needs
# for exact verification); "int8-per-pass" is the cheaper choice for a draft, whose numerics do not matter.
QUANTIZATIONS = {"int8": quantize_int8, "int8-per-pass": quantize_int8_per_pass}


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
