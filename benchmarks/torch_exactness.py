"""`python -m benchmarks.torch_exactness`: which verify widths of the torch runtime's real models give the logits
of one-token passes bit for bit, after a real prefill of each calibration context, next to what the calibration
(runtimes.pytorch.measure_exact_width) finds and how long it takes; -> a JSON file (docs/torch-exactness/widths.json).

Every width 2..16 is checked at every context, not only up to the first inexact one, so the table shows the whole
picture; the models are loaded one at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from importlib.metadata import version
from pathlib import Path

import torch

from specdec_exact.runtimes import TORCH
from specdec_exact.runtimes.pytorch import (
    CALIBRATION_CONTEXTS,
    CALIBRATION_WIDTHS,
    TorchRunner,
    context_length,
    exact_pass_widths,
    measure_exact_width,
    probe_tokens,
)

MODELS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
KINDS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "int8": (torch.float32, "int8")}


def measure(name: str, kind: str) -> dict:
    """One model in one kind: the calibration, then every width at each context after a real prefill."""
    dtype, quantization = KINDS[kind]
    model, _ = TORCH.load(name, dtype=dtype, quantization=quantization)
    load = os.getloadavg()[0]  # the machine's business when the calibration was timed
    started = time.perf_counter()
    found = measure_exact_width(model)
    calibration_s = time.perf_counter() - started
    rows = model.get_output_embeddings().out_features
    lengths = sorted({min(n, context_length(model.config) - max(CALIBRATION_WIDTHS)) for n in CALIBRATION_CONTEXTS})
    tokens = probe_tokens(rows, lengths[-1] + max(CALIBRATION_WIDTHS))
    sequence = TorchRunner(model, rows)
    after_prefill = {}
    for length in lengths:  # one sequence, prefilled further for each longer context
        sequence.forward(tokens[:, sequence.length:length], last_only=True)
        after_prefill[str(length)] = exact_pass_widths(sequence, tokens[:, length:], CALIBRATION_WIDTHS)
    del sequence, model
    gc.collect()
    return {"model": name, "kind": kind, "dtype": str(dtype).removeprefix("torch."), "quantization": quantization,
            "exact_widths_after_prefill": after_prefill,
            "calibrated": {"width": found.width, "longest_context": found.longest_context},
            "calibration_s": round(calibration_s, 2), "load_average_1min": round(load, 2)}


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="registry names (pulled)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--out", type=Path, default=Path("docs/torch-exactness/widths.json"),
                        help="written after each model; its rows for other models or kinds are kept")
    args = parser.parse_args(argv)
    try:
        rows = json.loads(args.out.read_text())["results"]
    except (OSError, ValueError, KeyError):
        rows = []
    for name in args.models:
        for kind in args.kinds:
            row = measure(name, kind)
            print(json.dumps(row), flush=True)
            rows = [r for r in rows if (r["model"], r["kind"]) != (name, kind)] + [row]
            write(args.out, rows)


def write(path: Path, rows: list[dict]) -> None:
    header = {"what": "widths w in 2..16 whose pass over w probe tokens after N cached tokens gives each position "
                      "the logits of one-token passes bit for bit (torch.equal); calibrated: what measure_exact_width "
                      "finds",
              "contexts": list(CALIBRATION_CONTEXTS), "widths": list(CALIBRATION_WIDTHS), "cpu": cpu_name(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": version("transformers")}
    lines = [f" {json.dumps(key)}: {json.dumps(value)}," for key, value in header.items()]
    results = ",\n".join(f"  {json.dumps(row)}" for row in rows)  # one result a line
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + "\n".join(lines) + '\n "results": [\n' + results + "\n ]\n}\n")


if __name__ == "__main__":
    main()
