"""Probe: cold prefill seconds of the servers benchmark's long prompts, passes merged (as calibrated) or one per
segment, interleaved; the same logits either way."""
import json, statistics, time
import torch
from specdec_exact import registry
from specdec_exact.runtimes import llamacpp
from specdec_exact.runtimes.llamacpp import runner as runner_module, read_tokenizer
from specdec_exact.runtimes.llamacpp.model import LlamaCppModel

path = registry.gguf_file(registry.DEFAULT_TARGET, progress=False)
model = LlamaCppModel(str(path), threads=2)
model.prepare()
tok = read_tokenizer(registry.gguf_tokenizer_dir(path))
prompts = [p for p in json.load(open("benchmarks/data/server_prompts.json"))["prompts"]
           if p["kind"] in ("code-edit", "document-qa", "summary")]
planned = runner_module.plan_passes
def prefill(ids, merge):
    runner_module.plan_passes = planned if merge else (lambda *a: planned(*a[:5], None))
    r = model.pool(1).take(model.n_vocab)
    t = time.perf_counter(); out = r.forward(torch.tensor([ids]), last_only=True); dt = time.perf_counter() - t
    r.close(); return dt, out
times = {(p["id"], m): [] for p in prompts for m in (0, 1)}
for _ in range(3):
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, return_dict=True)["input_ids"]
        a = prefill(list(ids), False); b = prefill(list(ids), True)
        assert torch.equal(a[1], b[1]), p["id"]
        times[p["id"], 0].append(a[0]); times[p["id"], 1].append(b[0])
tot = [0, 0]
for p in prompts:
    o, n = statistics.median(times[p["id"], 0]), statistics.median(times[p["id"], 1]); tot[0] += o; tot[1] += n
    print(f"{p['id']}: one pass a segment {o*1e3:.0f} ms, merged {n*1e3:.0f} ms, {n/o:.3f}x; logits identical")
print(f"all: {tot[1]/tot[0]:.3f}x")
