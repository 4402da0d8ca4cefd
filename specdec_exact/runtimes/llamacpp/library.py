"""Loading llama.cpp: llama-cpp-python's bindings of its C API, initialised once and kept quiet."""

from __future__ import annotations

import collections
import ctypes
import functools
import importlib.util
import logging
import os
from pathlib import Path

PIN = "llama-cpp-python==0.3.36"
log = logging.getLogger("llama.cpp")


class LlamaCppUnavailable(ValueError):
    """The llama.cpp runtime was asked for, but llama-cpp-python is not installed in this environment."""


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def library():
    """The llama_cpp module, its backend initialised and its log silenced (model loading chatter would bury our own
    output), once."""
    _load_own_ggml()
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable(
            f"the llama.cpp runtime needs {PIN}: run `make setup` (it builds the wheel once and caches it), or use "
            "--runtime torch") from None
    _initialise(llama_cpp)
    return llama_cpp


# The wheel's ggml libraries, in the order they need each other (by their sonames, as libllama names them).
OWN_GGML = ("libggml-base.so.0", "libggml-cpu.so.0", "libggml.so.0")


@functools.cache
def _load_own_ggml() -> None:
    """Load the wheel's own ggml libraries by their paths, before llama-cpp-python loads libllama. Its libraries find
    each other through a RUNPATH, which LD_LIBRARY_PATH overrides: on a machine with another llama.cpp build on that
    path, libllama would run that build's ggml, without specdec's kernel patch (every pass would fail). A library
    already loaded under a soname is the one the dynamic linker gives whoever needs that soname afterwards."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = Path(spec.submodule_search_locations[0]) / "lib"
    for name in OWN_GGML:
        if (folder / name).is_file():
            ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)


@functools.cache
def _initialise(llama_cpp) -> None:
    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_quiet(llama_cpp), ctypes.c_void_p())


WARN, ERROR, CONT = 3, 4, 5  # ggml_log_level values (ggml.h): warnings, errors, the continuation of the last line
_recent_problems: collections.deque[str] = collections.deque(maxlen=20)  # llama.cpp's last warnings and errors
_last_level = [0]


@functools.cache
def _quiet(llama_cpp):
    """The log callback, kept alive by the cache (llama.cpp holds the pointer): its chatter (model loading, INFO) is
    dropped; its warnings and errors go to the "llama.cpp" logger at DEBUG level and are kept, for the message of a
    call that fails (recent_problems)."""

    def keep(level, text, user_data):
        level = _last_level[0] if level == CONT else level
        _last_level[0] = level
        if level in (WARN, ERROR) and text:
            line = text.decode(errors="replace").rstrip()
            if line:
                _recent_problems.append(line)
                log.debug("%s", line)

    return llama_cpp.llama_log_callback(keep)


def recent_problems(clear: bool = True) -> str:
    """What llama.cpp warned of or reported as errors lately ("" if nothing), e.g. for the message of a failed
    llama_decode, which returns only a status code; cleared unless clear is False."""
    lines = list(_recent_problems)
    if clear:
        _recent_problems.clear()
    return "; ".join(lines[-5:])


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
