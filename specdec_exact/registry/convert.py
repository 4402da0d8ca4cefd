"""Transformers directories made from GGUF files: an fp32 checkpoint plus tokenizer, or a tokenizer alone.

A registered model is converted once because dequantizing GGUF at every load is far slower than loading the plain
safetensors copy. Each directory is written under a temporary name, its marker last, and renamed into place, so an
interrupted conversion (Ctrl-C, OOM kill, full disk) never leaves a directory that passes as good.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from specdec_exact.registry import cache, resources
from specdec_exact.registry.cache import MARKER


def load_gguf(gguf_path: Path, progress: bool):
    """(model, tokenizer) dequantized to fp32 from a GGUF file; needs `accelerate` installed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def save_transformers_copy(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Dequantize a GGUF into an fp32 transformers checkpoint plus tokenizer in out_dir."""
    model, tokenizer = load_gguf(gguf_path, progress)
    # transformers 5.24 refuses to save a GGUF-loaded model ("not serializable") while it still looks quantized;
    # its weights are already plain fp32 tensors, so dropping the quantizer and its config makes it an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, marker: dict | None = None,
                 progress: bool = False) -> Path:
    """Convert a GGUF file into a transformers checkpoint directory, atomically.

    Everything, the marker last, is written into a temporary sibling directory that is then renamed to out_dir, so
    out_dir either does not exist or is complete. An existing out_dir is replaced.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.converting")
    old = out_dir.with_name(f".{out_dir.name}.old")
    for leftover in (tmp, old):  # from an interrupted earlier run
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        tmp.mkdir()
        save_transformers_copy(gguf_path, tmp, progress)
        marker = {"source": str(gguf_path), **(marker or {}), "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def gguf_fp32_bytes(gguf_path: Path) -> int:
    """The size of the fp32 checkpoint a GGUF file converts to, from its tensor table."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)  # memory-maps; reads only the header and tensor table
    return 4 * sum(int(tensor.n_elements) for tensor in reader.tensors)


def cached_dir_for_gguf(gguf_path: str | os.PathLike, progress: bool = True) -> Path:
    """Convert a user-supplied .gguf file into the cache once; later calls reuse it until the file changes."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    stat = gguf_path.stat()
    out_dir = cache.converted_gguf_dir(gguf_path)
    if cache.read_marker(out_dir) is not None:
        return out_dir
    with cache.locked(f"gguf-local-{out_dir.name}"):
        if cache.read_marker(out_dir) is not None:  # converted by another process while we waited
            return out_dir
        fp32_bytes = gguf_fp32_bytes(gguf_path)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        resources.check_disk(out_dir.parent, fp32_bytes, f"converting {gguf_path.name}")
        resources.check_memory(resources.conversion_ram_bytes(fp32_bytes), f"converting {gguf_path.name}")
        return convert_gguf(gguf_path, out_dir, {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}, progress)


def gguf_tokenizer_dir(gguf_path: str | os.PathLike) -> Path:
    """A transformers tokenizer read out of a GGUF file's metadata once, then loaded from the cache."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = cache.tokenizer_dir(gguf_path)
    if cache.read_marker(out_dir) is not None:
        return out_dir
    with cache.locked(f"tokenizer-{out_dir.name}"):
        if cache.read_marker(out_dir) is None:
            from transformers import AutoTokenizer

            tmp = out_dir.with_name(f".{out_dir.name}.partial")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
                (tmp / MARKER).write_text(json.dumps({"source": str(gguf_path)}) + "\n")
                tmp.rename(out_dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return out_dir
