"""The errors the registry raises on purpose, in one place so that every part and every caller share them."""

from __future__ import annotations


class RegistryError(Exception):
    """Base class for every error the registry raises on purpose; its message says what to do."""


class UnknownModel(RegistryError):
    """A name that is not in the table of models."""


class ModelNotAvailable(RegistryError):
    """A registered model whose packages are not installed."""


class ChecksumMismatch(RegistryError):
    """GGUF bytes whose size or sha256 differ from the table's."""


class InsufficientResources(RegistryError):
    """Too little free RAM or disk for a pull or a conversion: refused before it starts."""
