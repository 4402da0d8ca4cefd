"""Are a prompt's KV rows the same however its prefill is cut into passes? The default target's prefill model (the
layout prompts run in) evaluates each chat prompt given (ids of benchmarks/data/server_prompts.json, with the chat
template) cut as served (context.prefill_segments: 128-token blocks and messages) and in one pass; every layer's keys
and values of positions 0..n-1 are then compared byte for byte, and the logits of the last row. Usage, from the
repository with its .venv: .venv/bin/python docs/kv-rows-by-passes-zen4/measure.py PROMPT_ID [...]"""

import json
import sys
from pathlib import Path

import numpy as np

from specdec_exact import SpeculativeGenerator
from specdec_exact.bench.runner import machine_info, versions
from specdec_exact.runtimes.llamacpp.calibration import cache_rows
from specdec_exact.runtimes.llamacpp.context import Context, evaluate, prefill_segments

ROOT = Path(__file__).resolve().parents[2]


def prefill(model, tokens: list[int], ends: list[int]) -> tuple[list[bytes], np.ndarray]:
    context = Context(model, len(tokens) + 16)
    try:
        start, rows = 0, None
        for end in ends:
            rows = evaluate(model, context, [(0, i, tokens[i], i == end - 1) for i in range(start, end)])
            start = end
        return cache_rows(context.save_state(0), len(tokens)), rows[-1]
    finally:
        context.free()


def main(ids: list[str]) -> None:
    data = json.loads((ROOT / "benchmarks/data/server_prompts.json").read_text())
    prompts = {p["id"]: p["prompt"] for p in data["prompts"]}
    gen = SpeculativeGenerator("qwen2.5-coder-1.5b-instruct", "none", threads=2, prompt_cache=0)
    target = gen.target
    print(json.dumps({"command": " ".join(sys.argv), "machine": machine_info(), "versions": versions(),
                      "kernel_plan": target.kernel_plan.describe()}))
    there = target.prefill_model
    for prompt_id in ids:
        tokens = gen.encode(prompts[prompt_id], True)
        tokens = tokens if isinstance(tokens, list) else tokens[0].tolist()
        ends = [end for end, _ in prefill_segments(tokens, target.segment_marks, target.answer_start)]
        cut_kv, cut_logits = prefill(there, tokens, ends)
        whole_kv, whole_logits = prefill(there, tokens, [len(tokens)])
        same_rows = [a == b for a, b in zip(cut_kv, whole_kv)] if cut_kv and whole_kv else None
        print(json.dumps({"prompt_id": prompt_id, "tokens": len(tokens), "passes": ends,
                          "kv_buffers_equal": None if same_rows is None else f"{sum(same_rows)}/{len(same_rows)}",
                          "last_logits_equal": bool(np.array_equal(cut_logits, whole_logits)),
                          "last_logits_max_difference": float(np.abs(cut_logits - whole_logits).max())}))


if __name__ == "__main__":
    main(sys.argv[1:])
