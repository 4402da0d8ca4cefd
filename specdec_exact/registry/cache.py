"""Where the registry keeps what it makes, how a finished directory is recognised, and the per-model locks.

Layout (root: $SPECDEC_CACHE, else ~/.cache/specdec):
    <root>/<name>/                converted checkpoint; valid only with specdec-complete.json inside
    <root>/gguf/<name>-<sha>.gguf joined GGUF of a split model, kept for runtimes that read GGUF (llama.cpp)
    <root>/tokenizers/<key>/      tokenizers read out of GGUF files, for runtimes that need no conversion
    <root>/gguf-local/<key>/      conversions of user-supplied .gguf files, key = file stem, size, mtime
    <root>/.<name>.converting/    an in-progress conversion; safe to delete
    <root>/.locks/                one lock file per model, so that two processes never convert the same model
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from specdec_exact.registry.catalog import ModelSpec, get_spec

CACHE_ENV = "SPECDEC_CACHE"
MARKER = "specdec-complete.json"  # written last into a directory, before the rename that gives it its final name


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec").expanduser()


def model_dir(name: str) -> Path:
    """Where the converted checkpoint of a registered model lives once it is complete."""
    return cache_root() / name


def joined_gguf_path(spec: ModelSpec) -> Path:
    """The joined GGUF of a split model; the name carries the sha256 it was checked against."""
    return cache_root() / "gguf" / f"{spec.name}-{spec.sha256[:16]}.gguf"


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Where the conversion of one version of a user-supplied .gguf file lives."""
    return cache_root() / "gguf-local" / _file_version(gguf_path)


def tokenizer_dir(gguf_path: Path) -> Path:
    """Where the tokenizer read out of one version of a .gguf file lives."""
    return cache_root() / "tokenizers" / _file_version(gguf_path)


def _file_version(path: Path) -> str:
    """A key that changes when the file is replaced or rewritten: stem, size and modification time."""
    stat = path.stat()
    return f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def read_marker(directory: Path) -> dict | None:
    """The completion marker of a directory, or None if it is absent or unreadable (the directory is not done)."""
    try:
        return json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_cached(name: str) -> bool:
    """Whether a complete converted copy of the registry model is in the cache."""
    return checkpoint_ready(get_spec(name))


def checkpoint_ready(spec: ModelSpec) -> bool:
    """Whether the cached checkpoint is complete and was made from the GGUF the table names now."""
    marker = read_marker(model_dir(spec.name))
    # A changed sha256 in the registry (a new model version) makes the old conversion stale.
    return marker is not None and marker.get("source_sha256") == spec.sha256


@contextlib.contextmanager
def locked(key: str) -> Iterator[None]:
    """Serialize pulls/conversions of one model across processes; the OS drops the lock if the process dies."""
    lock_dir = cache_root() / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
