"""What one prefill pass costs by its width: the default target's passes of each width given, after START cached
tokens, in the model that runs a prompt's long segments (`prefill`: LlamaCppModel.prefill_model, the plain weight
layout here) or in the target itself (`target`: the calibrated kernel plan, multi-column kernels up to 16 tokens,
llama.cpp's repacked ones beyond), each width N times in turn, as JSON: the fastest and the median in milliseconds.
Usage, from the repository with its .venv:
.venv/bin/python docs/prefill-widths-zen4/widths.py prefill|target START N WIDTH [WIDTH ...] > OUT.json"""

import json
import sys
import time

from specdec_exact.bench.runner import machine_info, versions
from specdec_exact.registry import gguf_file
from specdec_exact.runtimes.llamacpp.calibration import probe_tokens
from specdec_exact.runtimes.llamacpp.context import evaluate
from specdec_exact.runtimes.llamacpp.model import LlamaCppModel


def main(where: str, start: int, n: int, widths: list[int]) -> None:
    target = LlamaCppModel(str(gguf_file("qwen2.5-coder-1.5b-instruct", progress=False)), threads=2)
    model = target.prefill_model if where == "prefill" else target
    tokens = probe_tokens(target, start + max(widths))[0].tolist()
    context = model.prefill_context(1, start + max(widths))
    if start:
        evaluate(model, context, [(0, i, tokens[i], False) for i in range(start)])
    seconds = {width: [] for width in widths}
    for _ in range(n):
        for width in widths:  # (in turn: drift in the machine's load falls on every width alike)
            context.remove(0, start)
            began = time.perf_counter()
            evaluate(model, context, [(0, i, tokens[i], i == start + width - 1) for i in range(start, start + width)])
            seconds[width].append(time.perf_counter() - began)
    passes = {width: {"fastest_ms": round(min(s) * 1e3, 1), "median_ms": round(sorted(s)[len(s) // 2] * 1e3, 1)}
              for width, s in seconds.items()}
    print(json.dumps({"command": " ".join(sys.argv), "machine": machine_info(), "versions": versions(),
                      "model": where, "repacked": model.repack, "kernel_plan": target.kernel_plan.describe(),
                      "start": start, "passes": passes}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(w) for w in sys.argv[4:]])
