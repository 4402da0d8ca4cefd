"""Target passes of 1-16 tokens under the calibrated kernel plan, after 16 cached tokens (the calibration's own
setting): the fastest and the median of N passes of each width given, in milliseconds, as JSON. Usage, from the
repository with its .venv: .venv/bin/python docs/verify-throughput-zen4/passes.py N WIDTH [WIDTH ...]
Under `perf record -g` it gives each kernel's share of a pass (see README.md)."""

import json
import sys
import time

from specdec_exact.bench.runner import machine_info, versions
from specdec_exact.registry import gguf_file
from specdec_exact.runtimes.llamacpp.calibration import private_runner, probe_tokens
from specdec_exact.runtimes.llamacpp.model import LlamaCppModel


def main(n: int, widths: list[int]) -> None:
    model = LlamaCppModel(str(gguf_file("qwen2.5-coder-1.5b-instruct", progress=False)), threads=2)
    tokens = probe_tokens(model, 16 + max(widths))
    runner = private_runner(model, tokens.shape[1])
    runner.forward(tokens[:, :16], last_only=True)
    found = {}
    for width in widths:
        seconds = []
        for _ in range(n):
            runner.rollback(16)
            started = time.perf_counter()
            runner.forward(tokens[:, 16:16 + width])
            seconds.append(time.perf_counter() - started)
        seconds.sort()
        found[width] = {"fastest_ms": round(seconds[0] * 1e3, 2),
                        "median_ms": round(seconds[len(seconds) // 2] * 1e3, 2)}
    print(json.dumps({"command": " ".join(sys.argv), "machine": machine_info(), "versions": versions(),
                      "kernel_plan": model.kernel_plan.describe(), "passes": found}))


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(w) for w in sys.argv[2:]])
