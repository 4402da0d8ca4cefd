"""Pulling a registered model (install its packages, verify its GGUF, convert it once), and what is there already."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec_exact.progress import step
from specdec_exact.registry import cache, gguf_files, packages, resources
from specdec_exact.registry.catalog import MODELS, ModelSpec, get_spec
from specdec_exact.registry.convert import convert_gguf
from specdec_exact.registry.errors import ModelNotAvailable


def pull(name: str, progress: bool = True) -> Path:
    """Install the pinned packages if missing, join and verify the GGUF, convert it; return the checkpoint dir.

    Idempotent and safe to interrupt: a re-run skips what is done and redoes what was cut short.
    """
    spec = get_spec(name)
    if cache.checkpoint_ready(spec):
        return cache.model_dir(name)
    root = cache.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with cache.locked(name):
        if cache.checkpoint_ready(spec):  # pulled by another process while we waited
            return cache.model_dir(name)
        missing = packages.missing_pins(spec)
        # The checkpoint, the joined GGUF (kept for llama.cpp), and if installing, pip's cache plus site-packages.
        disk_needed = spec.fp32_bytes + spec.gguf_bytes + (2 * spec.gguf_bytes if missing else 0)
        resources.check_disk(root, disk_needed, f"pulling {name}")
        resources.check_memory(resources.conversion_ram_bytes(spec.fp32_bytes), f"converting {name}")
        if missing:
            packages.pip_install(missing)
        return _prepare(spec, progress)


def _prepare(spec: ModelSpec, progress: bool) -> Path:
    """Join + verify + convert an installed model; caller holds the lock."""
    started = time.perf_counter()
    gguf_path = gguf_files.verified_gguf(spec, progress)
    verified = time.perf_counter()
    marker = {"name": spec.name, "source": "pip packages", "packages": list(spec.pins), "source_sha256": spec.sha256}
    with step(f"converting {gguf_path.name} into the torch runtime's copy (once)"):
        out_dir = convert_gguf(gguf_path, cache.model_dir(spec.name), marker, progress)
    converted = time.perf_counter()
    if progress:
        print(f"{spec.name}: join+verify {verified - started:.1f} s, convert {converted - verified:.1f} s "
              f"-> {out_dir}", file=sys.stderr)
    return out_dir


def local_model_dir(name: str) -> Path:
    """The converted checkpoint of a registered model; converts it first if only its packages are installed."""
    spec = get_spec(name)
    if cache.checkpoint_ready(spec):
        return cache.model_dir(name)
    if packages.missing_pins(spec):
        raise ModelNotAvailable(f"model {name} is not downloaded; run:  specdec-exact models pull {name}")
    return pull(name)


@dataclass(frozen=True)
class ModelRow:
    name: str
    installed: bool  # the pinned packages are installed
    cached: bool  # a complete converted checkpoint is in the cache
    gguf_bytes: int  # download size
    fp32_bytes: int  # converted size on disk


def list_models() -> list[ModelRow]:
    return [
        ModelRow(spec.name, packages.is_installed(spec.name), cache.checkpoint_ready(spec), spec.gguf_bytes,
                 spec.fp32_bytes)
        for spec in MODELS.values()
    ]
