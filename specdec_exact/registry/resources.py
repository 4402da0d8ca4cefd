"""Free RAM and disk, checked before a pull or a conversion: refusing up front beats an OOM kill halfway."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from specdec_exact.registry.cache import CACHE_ENV
from specdec_exact.registry.errors import InsufficientResources

GB = 1 << 30


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
            f"{purpose} needs about {needed_bytes / GB:.1f} GB of free RAM, but only {available / GB:.1f} GB is "
            f"available; close other programs, or set SPECDEC_IGNORE_MEMORY=1 to try anyway"
        )


def check_disk(directory: Path, needed_bytes: int, purpose: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise InsufficientResources(
            f"{purpose} needs about {needed_bytes / GB:.1f} GB of free disk in {directory}, but only "
            f"{free / GB:.1f} GB is free; free some space or point {CACHE_ENV} at a bigger disk"
        )


def conversion_ram_bytes(fp32_bytes: int) -> int:
    """RAM a GGUF -> fp32 conversion needs: it holds the GGUF tensors and the fp32 model at once. The peak RSS
    measured while converting each registered model stays under this bound, with a margin."""
    return int(1.5 * fp32_bytes) + 3 * GB // 4
