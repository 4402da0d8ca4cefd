# A probe (not the benchmark): see README.md beside it.
"""Width-1 and width-2 passes per kernel, interleaved, many repeats: which kernel is fastest now."""
import statistics, sys, time
from specdec_exact.runtimes.llamacpp.model import LlamaCppModel
from specdec_exact.runtimes.llamacpp import kernels as K
from specdec_exact.runtimes.llamacpp.calibration import private_runner, probe_tokens
m = LlamaCppModel("/root/.cache/specdec/gguf/qwen2.5-coder-1.5b-instruct-cc324af070c2ecbf.gguf", threads=2, repack=True, prefill_repack=None)
cands = K.candidates()
toks = probe_tokens(m, 200 + 2)
r = private_runner(m, toks.shape[1])
m._kernel_plan = K.KernelPlan.uniform(K.LLAMA_CPP)
r.forward(toks[:, :200], last_only=True)
sec = {(w, k): [] for w in (1, 2) for k in cands}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
    for w in (1, 2):
        for i in range(len(cands)):
            k = cands[(i + rnd) % len(cands)]
            m._kernel_plan = K.KernelPlan.uniform(k)
            r.rollback(200)
            t = time.perf_counter(); r.forward(toks[:, 200:200 + w]); sec[(w, k)].append(time.perf_counter() - t)
for (w, k), v in sec.items():
    print(w, k.describe().ljust(40), "min %.1f med %.1f" % (min(v) * 1e3, statistics.median(v) * 1e3))
