"""Which of llama.cpp's weight layouts, plain or repacked for the CPU, a model file runs faster in on this CPU.

Measured once per file and machine in a worker process (the repacked layouts crashed llama.cpp on an AMX Xeon: a
crash there says plain for both), under every candidate kernel (specdec_exact.runtimes.llamacpp.kernels), then cached.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_exact.runtimes.llamacpp.calibration import (cached_json, private_runner, probe_tokens,
                                                         time_one_token_passes)

LAYOUT_TIMING_TIMEOUT_S = 600  # loading a model twice, 84 one-token passes and 4 prompts: seconds, even for a 7B
PREFILL_PROBE_TOKENS = 128  # a typical chat prompt, for timing prefills in each layout
LAYOUT_PREFILLS = 2  # prompts timed in each layout, in turn (the faster counts: a busy moment only slows one down)
LAYOUT_ROUNDS = 6  # one-token passes under each kernel in each layout, in turn (the first one warms up, not counted)


def choose_layouts(path: Path, threads: int, details: bool = False) -> dict:
    """Which of llama.cpp's weight layouts, plain or repacked for the CPU, give this file on this CPU the faster
    one-token passes ("repack": by 3% or more) and the faster prompts ("prefill_repack"): measured once, in a worker
    process, since the repacked layouts crashed llama.cpp on an AMX Xeon (a crash there says plain for both), then
    cached. details: all that was measured (the times of every candidate kernel in each layout)."""
    found = cached_json(Path(path), "layouts", f"{threads}|prefill", lambda: measure_layouts(path, threads),
                         {"threads": threads})
    if details:
        return found
    return {"repack": found["repack"], "prefill_repack": found.get("prefill_repack", found["repack"])}


def measure_layouts(path: Path, threads: int) -> dict:
    import json
    import subprocess

    # A fresh interpreter, not a multiprocessing worker: that would re-run the caller's script (a script without a
    # __main__ guard would start over in it), and it must not inherit this process's llama.cpp and torch threads.
    code = ("import sys; from specdec_exact.runtimes.llamacpp.layouts import time_layouts; "
            "time_layouts(sys.argv[1], int(sys.argv[2]))")
    try:
        worker = subprocess.run([sys.executable, "-c", code, str(path), str(threads)], capture_output=True,
                                text=True, timeout=LAYOUT_TIMING_TIMEOUT_S)
        exit_code = worker.returncode
        (plain, repacked), (plain_prefill_s, repacked_prefill_s) = json.loads(worker.stdout.splitlines()[-1])
        plain_s, repacked_s = min(plain.values()), min(repacked.values())
    except subprocess.TimeoutExpired:  # hung: as good as a crash
        exit_code = "timeout"
    except (ValueError, IndexError):  # the worker died: with the repacked layouts, or at all
        pass
    else:
        return {"repack": repacked_s < 0.97 * plain_s, "prefill_repack": repacked_prefill_s < 0.97 * plain_prefill_s,
                "one_token_s": {"plain": plain_s, "repacked": repacked_s},
                "one_token_s_by_kernel": {"plain": plain, "repacked": repacked},
                "prefill_s": {"tokens": PREFILL_PROBE_TOKENS, "plain": plain_prefill_s, "repacked": repacked_prefill_s}}
    return {"repack": False, "prefill_repack": False, "worker_exit_code": exit_code}


def time_layouts(path: str, threads: int) -> None:
    """In the worker: the median seconds of a one-token pass after 16 tokens under each candidate kernel
    (specdec_exact.kernels.candidates, llama.cpp's own among them) in each layout, and the fastest of a
    PREFILL_PROBE_TOKENS prompt's, plain and repacked layouts and the kernels interleaved, printed as JSON."""
    import json
    import statistics
    import time

    from specdec_exact.runtimes.llamacpp.kernels import LLAMA_CPP as LLAMA_CPP_KERNELS
    from specdec_exact.runtimes.llamacpp.kernels import KernelPlan, candidates
    from specdec_exact.runtimes.llamacpp.model import LlamaCppModel

    models = [LlamaCppModel(path, threads, repack=repack, prefill_repack=None) for repack in (False, True)]
    for model in models:  # prompts take llama.cpp's own kernels under any plan; no plan is calibrated here
        model._kernel_plan = KernelPlan.uniform(LLAMA_CPP_KERNELS)
        # Nor is anything else: the caller holds the machine's calibration lock while this worker runs, so a
        # calibration asked for here (a prompt's pass-merging) would wait for it until the timeout. The probe prompt
        # is one pass either way.
        model._measured["pass-merging"] = {"merge_from": None}
    tokens = probe_tokens(models[0], PREFILL_PROBE_TOKENS)
    runners = [private_runner(model, PREFILL_PROBE_TOKENS) for model in models]
    kernels = candidates()
    one_token, prefill = [{kernel: [] for kernel in kernels} for _ in models], [[], []]
    for _ in range(LAYOUT_PREFILLS):
        for runner, times in zip(runners, prefill):
            runner.rollback(0)
            started = time.perf_counter()
            runner.forward(tokens, last_only=True)
            times.append(time.perf_counter() - started)
    for _ in range(LAYOUT_ROUNDS):
        for model, runner, times in zip(models, runners, one_token):
            time_one_token_passes(model, runner, tokens[:, :17], times)
    print(json.dumps([[{kernel.describe(): statistics.median(t[1:]) for kernel, t in times.items()}
                       for times in one_token], [min(times) for times in prefill]]))


