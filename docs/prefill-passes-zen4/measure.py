"""How a prompt's prefill passes cost: the default target (`--draft none`, 2 threads) prefills each chat prompt given
(ids of benchmarks/data/server_prompts.json) cold, cut as each setting given says (BLOCK/TAIL: context.PREFILL_BLOCK
and PREFILL_TAIL patched; 128/1 or 128: blocks of 128 tokens whatever follows them, as served; 128/64: a block
boundary that a message's start follows within 63 tokens left out, at the commit that tried it (PREFILL_TAIL; without
it the setting changes nothing); 4096: the whole prompt in one pass), the settings in turn for each prompt, their
order rotated from round to round; every llama.cpp pass timed (tokens, milliseconds). Usage, from the repository with
its .venv: .venv/bin/python docs/prefill-passes-zen4/measure.py OUT.json ROUNDS SETTINGS PROMPT_ID [...] (SETTINGS:
comma-separated, such as 128/1,128/64,4096/1)"""

import json
import sys
import time
from pathlib import Path

import specdec_exact.runtimes.llamacpp.context as context
from specdec_exact import SpeculativeGenerator
from specdec_exact.bench.runner import machine_info, versions

ROOT = Path(__file__).resolve().parents[2]
passes: list[tuple[int, float]] = []
evaluate = context.evaluate


def timed(model, ctx, entries):
    started = time.perf_counter()
    rows = evaluate(model, ctx, entries)
    passes.append((len(entries), round((time.perf_counter() - started) * 1e3, 1)))
    return rows


def main(out: Path, rounds: int, settings: list[str], ids: list[str]) -> None:
    for module in list(sys.modules.values()):  # every module that imported evaluate by name
        named = getattr(module, "__name__", "")
        if named.startswith("specdec_exact") and getattr(module, "evaluate", None) is evaluate:
            module.evaluate = timed
    data = json.loads((ROOT / "benchmarks/data/server_prompts.json").read_text())
    prompts = {p["id"]: p["prompt"] for p in data["prompts"]}
    gen = SpeculativeGenerator("qwen2.5-coder-1.5b-instruct", "none", threads=2, prompt_cache=0)
    gen.generate("Say hello.", max_new_tokens=4, chat=True)  # (warm-up)
    records = []
    for round_ in range(rounds):
        for prompt_id in ids:
            for setting in settings[round_ % len(settings):] + settings[:round_ % len(settings)]:
                context.PREFILL_BLOCK, context.PREFILL_TAIL = (int(n) for n in (setting + "/1").split("/")[:2])
                passes.clear()
                started = time.perf_counter()
                gen.generate(prompts[prompt_id], max_new_tokens=1, chat=True)
                records.append({"round": round_, "setting": setting, "prompt_id": prompt_id,
                                "seconds": time.perf_counter() - started, "passes": list(passes)})
                print(records[-1])
    out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine_info(), "versions": versions(),
                               "kernel_plan": gen.target.kernel_plan.describe(), "records": records}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4:])
