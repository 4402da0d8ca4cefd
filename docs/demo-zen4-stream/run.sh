#!/usr/bin/env bash
# `make demo`, warm (set-up, models, llama-server and calibration in place), ROUNDS times in a row: each run's output
# (demo-N.log) and wall time, then results.json (each run's figures from its log, their medians, the machine,
# versions). Usage: docs/demo-zen4-stream/run.sh OUT [ROUNDS]
set -u
out=${1:?an output folder}; rounds=${2:-5}
cd "$(dirname "$0")/../.."  # the repository
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  start=$(date +%s.%N)
  make demo > "$out/demo-$round.log" 2>&1 || { echo "make demo failed: $out/demo-$round.log" >&2; exit 1; }
  echo "$(date +%s.%N) - $start" | bc > "$out/wall-$round.txt"
done
.venv/bin/python - "$out" "$rounds" "$(git rev-parse --short HEAD)" <<'PY'
import json, platform, re, statistics, sys
from importlib.metadata import version
from pathlib import Path

out, rounds, commit = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
number = r"([0-9.]+) tokens/s"
runs = []
for n in range(1, rounds + 1):
    log = (out / f"demo-{n}.log").read_text()
    runs.append({"wall_s": round(float((out / f"wall-{n}.txt").read_text()), 2),
                 "shown": float(re.search(r"tokens in [0-9.]+ s: " + number, log).group(1)),
                 "specdec": float(re.search(r"specdec " + number, log).group(1)),
                 "target_only": float(re.search(r"target-only: " + number, log).group(1)),
                 "llama_server": float(re.search(r"over HTTP\): " + number, log).group(1)),
                 "identical": "(identical output)" in log,
                 "load": re.search(r"done in [0-9]+ s", log).group(0)})
medians = {key: statistics.median(run[key] for run in runs)
           for key in ("wall_s", "shown", "specdec", "target_only", "llama_server")}
cpu = Path("/proc/cpuinfo").read_text()
field = lambda key: re.search(rf"^{key}\s*: (.*)$", cpu, re.M).group(1)  # noqa: E731
(out / "results.json").write_text(json.dumps({
    "command": f"docs/demo-zen4-stream/run.sh OUT {rounds}", "code": commit,
    "machine": {"cpu": field("model name"), "family": int(field("cpu family")), "model": int(field("model")),
                "flags": [f for f in field("flags").split() if f.startswith(("avx", "amx", "vp2"))],
                "cores": cpu.count("processor\t:"), "python": platform.python_version()},
    "versions": {name: version(name) for name in ("llama_cpp_python", "torch", "transformers")},
    "runs": runs, "medians": medians,
    "speedup_medians": {"vs_target_only": medians["specdec"] / medians["target_only"],
                        "vs_llama_server": medians["specdec"] / medians["llama_server"]}}, indent=1) + "\n")
print(json.dumps({"medians": medians}))
PY
