"""Loading llama.cpp: llama-cpp-python's bindings of its C API, initialised once and kept quiet."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

PIN = "llama-cpp-python==0.3.36"


class LlamaCppUnavailable(ValueError):
    """The llama.cpp runtime was asked for, but llama-cpp-python is not installed in this environment."""


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def library():
    """The llama_cpp module, its backend initialised and its log silenced (model loading chatter would bury our own
    output), once."""
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable(
            f"the llama.cpp runtime needs {PIN}: run `make setup` (it builds the wheel once and caches it), or use "
            "--runtime torch") from None
    _initialise(llama_cpp)
    return llama_cpp


@functools.cache
def _initialise(llama_cpp) -> None:
    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_quiet(llama_cpp), ctypes.c_void_p())


@functools.cache
def _quiet(llama_cpp):
    """The log callback that drops every line, kept alive by the cache: llama.cpp holds the pointer."""
    return llama_cpp.llama_log_callback(lambda level, text, user_data: None)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def kernels_id() -> str:
    """A digest of the installed llama.cpp CPU kernels (libggml-cpu): two builds of the same llama-cpp-python release,
    with and without specdec's kernel patch or for another CPU, calibrate differently."""
    import hashlib

    folder = Path(library().__file__).parent / "lib"
    libraries = sorted(folder.glob("libggml-cpu*")) or sorted(folder.glob("*ggml*"))
    return hashlib.sha256(libraries[0].read_bytes()).hexdigest()[:16] if libraries else ""
