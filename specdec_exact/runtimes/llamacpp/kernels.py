"""The kernel plan: which of llama.cpp's CPU kernels take a pass of each width (1-16 tokens), chosen on this machine.

specdec's patch to llama.cpp (native/llama.cpp-verify-columns.patch) adds multi-column K-quant kernels: a pass over a
few tokens unpacks each weight block once for all of them, and every token's result is bit-identical to llama.cpp's
own one-column kernel's. They come in variants: 256- or 512-bit registers (the 512-bit Q6_K path; two repacked Q4_K
row groups per register), and how far ahead they prefetch the weights. Which is fastest depends on the CPU: one that
executes 512-bit instructions in two halves (AMD Zen 4) loses with the wide paths, one whose prefetchers keep up
loses with software prefetches, and llama.cpp's own kernels are often the fastest for one-token passes. So nothing is
compiled in: the library takes a plan at run time (ggml_cpu_set_kernel_plan), one kernel per width, and
measure_kernel_plan times every candidate at every width on this machine, llama.cpp's own kernels among them, and
keeps the fastest whose pass gives every token the logits of a one-token pass bit for bit. Each model has its plan
(LlamaCppModel.kernel_plan); it is set in the library before each of the model's passes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

MAX_WIDTH = 16  # the widest pass a plan covers; wider ones always take llama.cpp's own kernels
MULTI_COLUMN = 1  # the flag bits of native/llama.cpp-verify-columns.patch (GGML_KERNEL_*)
WIDE = 2
PREFETCH_DISTANCES = (0, 4096, 16384)  # bytes ahead that the multi-column kernels may prefetch the weights
PLAN_PREFIX = 16  # cached tokens before the timed passes (the calibration's short context)
PLAN_REPEATS = 3  # timed passes per candidate and width, interleaved; the fastest counts
# After the first round a width times again only the exact candidates within this factor of its fastest so far, and
# after the second within the next: a kernel 1.5-2.4x slower (llama.cpp's own at 8-16 tokens here) or inexact cannot
# win, and most candidates end within 1-5% of each other, where a few more passes would choose between near-equals
# at the price of the first load (EPYC Zen 4, 2 threads, the 1.5B target: 71 s with five rounds and no pruning, 53 s
# pruned at 1.3 and 1.12, 534 passes for the 0.5B draft in 40 s).
PLAN_MARGINS = (1.1, 1.05)
# Width 1 (every answer's decoding passes where nothing is drafted) is timed in this many rounds, every exact candidate
# in each, none pruned: a one-token pass caught in a burst of another process's work must not drop its kernel. (EPYC
# Zen 4: a first round's 39.5 ms against llama.cpp's own 32.5 ms pruned the multi-column kernel that 20 interleaved
# rounds later timed at 32.2 ms against 33.8 ms after 200 cached tokens: docs/kernel-one-token-zen4.)
ONE_TOKEN_REPEATS = 12


@dataclass(frozen=True)
class Kernel:
    """One candidate for a width: flags (MULTI_COLUMN, WIDE) and the prefetch distance in bytes."""

    flags: int = 0
    prefetch: int = 0

    def describe(self) -> str:
        if not self.flags & MULTI_COLUMN:
            return "llama.cpp's own"
        prefetch = f"prefetch {self.prefetch // 1024} KB" if self.prefetch else "no prefetch"
        return f"multi-column {'512' if self.flags & WIDE else '256'}-bit, {prefetch}"


LLAMA_CPP = Kernel()


@dataclass(frozen=True)
class KernelPlan:
    """The kernel for each pass width 1..MAX_WIDTH."""

    kernels: tuple[Kernel, ...]

    def __post_init__(self):
        if len(self.kernels) != MAX_WIDTH:
            raise ValueError(f"a kernel plan names a kernel for each width 1-{MAX_WIDTH}, got {len(self.kernels)}")

    @classmethod
    def uniform(cls, kernel: Kernel) -> KernelPlan:
        return cls((kernel,) * MAX_WIDTH)

    @classmethod
    def from_json(cls, found: list) -> KernelPlan:
        return cls(tuple(Kernel(int(flags), int(prefetch)) for flags, prefetch in found))

    def to_json(self) -> list:
        return [[kernel.flags, kernel.prefetch] for kernel in self.kernels]

    @property
    def key(self) -> str:
        """A short string naming the plan, for calibration cache keys."""
        return ",".join(f"{k.flags}:{k.prefetch}" for k in self.kernels)

    def describe(self) -> str:
        """The plan as runs of widths: "1: llama.cpp's own; 2-16: multi-column 256-bit, prefetch 4 KB"."""
        runs, start = [], 1
        for width in range(2, MAX_WIDTH + 2):
            if width > MAX_WIDTH or self.kernels[width - 1] != self.kernels[start - 1]:
                name = str(start) if start == width - 1 else f"{start}-{width - 1}"
                runs.append(f"{name}: {self.kernels[start - 1].describe()}")
                start = width
        return "; ".join(runs)

    def apply(self) -> None:
        """Make this the plan of the library's next passes (a no-op when it already is)."""
        global _applied
        if _applied != self:
            flags = (ctypes.c_int * MAX_WIDTH)(*(k.flags for k in self.kernels))
            prefetch = (ctypes.c_int * MAX_WIDTH)(*(k.prefetch for k in self.kernels))
            loaded_library().ggml_cpu_set_kernel_plan(MAX_WIDTH, flags, prefetch)
            _applied = self


_applied: KernelPlan | None = None


@functools.cache
def loaded_library() -> ctypes.CDLL:
    """The libggml-cpu that llama-cpp-python loaded, with the kernel plan's entry points. Its wheel holds copies, not
    links (libggml-cpu.so, .so.0, .so.0.25.3): opening another of them would load a second library with a plan of its
    own, which no pass reads. So the one already mapped into this process is opened again."""
    from specdec_exact.runtimes.llamacpp.library import library

    folder = Path(library().__file__).parent / "lib"  # loads llama.cpp, and with it libggml-cpu
    try:
        with open("/proc/self/maps") as maps:
            loaded = [line.split()[-1] for line in maps if "/libggml-cpu" in line]
    except OSError:  # not Linux: the library by its usual name
        loaded = []
    names = loaded or sorted(str(path) for path in folder.glob("libggml-cpu*"))
    library = ctypes.CDLL(names[0]) if names else None
    if library is None or not hasattr(library, "ggml_cpu_set_kernel_plan"):
        raise RuntimeError("the installed llama-cpp-python lacks specdec's kernel plan (native/): run `make setup`, "
                           "which builds it with the patch for this CPU")
    library.ggml_cpu_set_kernel_plan.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                                 ctypes.POINTER(ctypes.c_int)]
    library.ggml_cpu_set_kernel_plan.restype = None
    library.ggml_cpu_kernel_flags_available.restype = ctypes.c_int
    if not hasattr(library, "ggml_cpu_set_flash_attn_split"):
        raise RuntimeError("the installed llama-cpp-python has an older build of specdec's kernel patch (native/): run "
                           "`make setup`, which builds the current one for this CPU")
    library.ggml_cpu_set_flash_attn_split.argtypes = [ctypes.c_int]
    library.ggml_cpu_set_flash_attn_split.restype = None
    if not hasattr(library, "ggml_cpu_set_tiled_whole_columns"):
        raise RuntimeError("the installed llama-cpp-python has an older build of specdec's kernel patch (native/): run "
                           "`make setup`, which builds the current one for this CPU")
    library.ggml_cpu_set_tiled_whole_columns.argtypes = [ctypes.c_int]
    library.ggml_cpu_set_tiled_whole_columns.restype = None
    return library


_attention_split: bool | None = None  # what the library was last told (None: nothing yet, it splits as released)


def apply_attention_split(split: bool) -> None:
    """Whether the library's next one-token passes over an f16 cache of 512+ cells may split attention across threads
    (llama.cpp as released) or sweep each row in one pass, as wider passes do, so that a verify pass reproduces them
    at any context length (native/llama.cpp-verify-columns.patch, ggml_cpu_set_flash_attn_split). A no-op when the
    library already does."""
    global _attention_split
    if _attention_split is not split:
        loaded_library().ggml_cpu_set_flash_attn_split(int(split))
        _attention_split = split


_whole_columns: bool | None = None  # what the library was last told (None: nothing yet, it cuts as released)


def apply_tiled_whole_columns(whole: bool) -> None:
    """Whether the library's next wide passes through ggml's tiled K-quant kernels keep their tokens in column windows
    of up to 256, cutting only the weight rows between threads, or cut both as released
    (native/llama.cpp-verify-columns.patch, ggml_cpu_set_tiled_whole_columns). Each window unpacks every weight block
    of its rows once, so a pass of 129-256 tokens cut into two windows unpacks the weights twice. Either way each
    output is the same sum in the same order: the results are equal bit for bit, only the time differs. A no-op when
    the library already does."""
    global _whole_columns
    if _whole_columns is not whole:
        loaded_library().ggml_cpu_set_tiled_whole_columns(int(whole))
        _whole_columns = whole


def multi_column_kernels() -> bool:
    """Whether the multi-column kernels may be candidates in this process: GGML_CPU_MULTI_COLUMN=0 (as the patch reads
    it, like C's atoi) restricts every plan to llama.cpp's own kernels, for comparing with llama.cpp as released."""
    setting = os.environ.get("GGML_CPU_MULTI_COLUMN")
    digits = re.match(r"\s*[+-]?\d+", setting or "")
    return setting is None or (digits is not None and int(digits.group()) != 0)


def candidates() -> list[Kernel]:
    """Every kernel a plan may give a width on this build and CPU: llama.cpp's own first."""
    if not multi_column_kernels():
        return [LLAMA_CPP]
    available = loaded_library().ggml_cpu_kernel_flags_available()
    kinds = [MULTI_COLUMN] + ([MULTI_COLUMN | WIDE] if available & WIDE else [])
    return [LLAMA_CPP] + [Kernel(flags, distance) for flags in kinds for distance in PREFETCH_DISTANCES]


def measure_kernel_plan(model, repeats: int = PLAN_REPEATS) -> dict:
    """Time every candidate kernel at every width 1..MAX_WIDTH after PLAN_PREFIX cached tokens, interleaved (each
    round passes every width under every candidate in turn, so that a busy moment of the machine falls on all of
    them; width 1 in ONE_TOKEN_REPEATS rounds, the others in `repeats`, pruned as they go), and keep per width the
    fastest candidate whose pass gives every token the logits of llama.cpp's own
    one-token passes bit for bit (the first round checks). -> {"plan": KernelPlan.to_json(), "pass_s": {width:
    {kernel: its fastest pass, seconds}}, "exact": {width: [kernels whose pass was exact]}}. The chosen kernels' times
    are the model's pass costs (LlamaCppModel.costs): fastest passes, so that the ratio of two widths is that of two
    quiet passes, not of one quiet and one caught in a burst of another process's work. Longer contexts and batches
    are checked afterwards, under the chosen plan (measure_exact_widths, measure_batch_width)."""
    import torch

    from specdec_exact import progress
    from specdec_exact.runtimes.llamacpp.calibration import one_token_logits, private_runner, probe_tokens

    kernels = candidates()
    tokens = probe_tokens(model, PLAN_PREFIX + MAX_WIDTH)
    runner = private_runner(model, tokens.shape[1])
    try:
        model._kernel_plan = KernelPlan.uniform(LLAMA_CPP)
        runner.forward(tokens[:, :PLAN_PREFIX], last_only=True)
        reference = one_token_logits(runner, tokens[:, PLAN_PREFIX:])
        seconds = {width: {kernel: [] for kernel in kernels} for width in range(1, MAX_WIDTH + 1)}
        exact = {width: [] for width in range(1, MAX_WIDTH + 1)}
        timed = {width: list(kernels) for width in range(1, MAX_WIDTH + 1)}  # the candidates still in the running

        def time_round(round_: int) -> None:
            for width in timed:
                for i in range(len(timed[width])):
                    kernel = timed[width][(i + round_ + width) % len(timed[width])]  # a different order every time
                    model._kernel_plan = KernelPlan.uniform(kernel)
                    runner.rollback(PLAN_PREFIX)
                    started = time.perf_counter()
                    logits = runner.forward(tokens[:, PLAN_PREFIX:PLAN_PREFIX + width])
                    seconds[width][kernel].append(time.perf_counter() - started)
                    if round_ == 0 and torch.equal(logits[0], reference[:width]):
                        exact[width].append(kernel)

        for round_ in progress.each(range(repeats), f"{len(kernels)} kernels timed at widths 1-{MAX_WIDTH}", "round"):
            if round_:  # (width 1 keeps every exact candidate)
                margin = PLAN_MARGINS[min(round_, 2) - 1]
                timed = {width: still_running(seconds[width], exact[width], margin if width > 1 else float("inf"))
                         for width in timed}
            time_round(round_)
        timed = {1: still_running(seconds[1], exact[1], float("inf"))}
        for round_ in progress.each(range(repeats, ONE_TOKEN_REPEATS), f"{len(timed[1])} kernels' one-token passes "
                                    "timed again", "round"):
            time_round(round_)
    finally:
        model._kernel_plan = None
        runner.rollback(0)
    # The fastest of each candidate's passes: a busy moment of a shared machine only ever slows a pass down, so the
    # minimum is what the kernel can do (medians of 5 let one burst of another process's work pick the plan).
    fastest = {width: {kernel: min(times) for kernel, times in by_kernel.items()}
               for width, by_kernel in seconds.items()}
    plan = choose_plan(fastest, exact)
    return {"plan": plan.to_json(), "describe": plan.describe(),
            "pass_s": {str(width): {kernel.describe(): s for kernel, s in by_kernel.items()}
                       for width, by_kernel in fastest.items()},
            "exact": {str(width): [kernel.describe() for kernel in found] for width, found in exact.items()}}


def still_running(seconds: dict[Kernel, list[float]], exact: list[Kernel], margin: float) -> list[Kernel]:
    """The candidates of one width worth timing again: the exact ones whose fastest pass so far is within `margin`
    of the fastest exact one's (all of them where none was exact: the plan then keeps llama.cpp's own anyway)."""
    if not exact:
        return [LLAMA_CPP]
    best = min(min(seconds[kernel]) for kernel in exact)
    return [kernel for kernel in exact if min(seconds[kernel]) <= margin * best]


def choose_plan(seconds: dict[int, dict[Kernel, float]], exact: dict[int, list[Kernel]]) -> KernelPlan:
    """Per width, the fastest of the kernels that were exact there. A width where none was keeps llama.cpp's own
    kernels, and the exactness calibrations that follow (which check the plan in force) then verify fewer tokens at
    once; width 1 always has one, as llama.cpp's own one-token pass is the reference."""
    return KernelPlan(tuple(min(exact[width], key=seconds[width].get) if exact[width] else LLAMA_CPP
                            for width in range(1, MAX_WIDTH + 1)))
