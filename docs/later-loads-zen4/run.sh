#!/usr/bin/env bash
# Later starts of `specdec serve` with the default pair, calibrated before (the set-up's cache): seconds from the
# command to `/health` 200 (probed every 0.1 s) and the load's own time (its log), for each checkout given, in turn,
# ROUNDS times. Usage: docs/later-loads-zen4/run.sh OUT ROUNDS NAME=REPO [NAME=REPO ...] (REPO: a checkout whose
# package the repository's .venv imports when run from it, e.g. a git worktree of an earlier commit).
set -u
out=${1:?an output folder}; rounds=${2:?rounds}; shift 2
venv="$(cd "$(dirname "$0")/../.." && pwd)/.venv"
port=8431
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for named in "$@"; do
    name=${named%%=*}; repo=${named#*=}
    log="$out/$name-$round.log"
    start=$(date +%s.%N)
    (cd "$repo" && exec "$venv/bin/python" -m specdec.cli serve --port "$port" > "$log" 2>&1) &
    pid=$!
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health" 2>/dev/null)" = "200" ]; do
      kill -0 $pid 2>/dev/null || { echo "$name: the server ended" >&2; exit 1; }
      sleep 0.1
    done
    ready=$(echo "$(date +%s.%N) - $start" | bc)
    commit=$(git -C "$repo" rev-parse --short HEAD)
    printf '{"name": "%s", "commit": "%s", "round": %d, "health_200_s": %.2f}\n' "$name" "$commit" "$round" "$ready" \
      | tee -a "$out/ready.jsonl"
    kill $pid; wait $pid 2>/dev/null
  done
done
# results.json: the probes, each load's own line from its log, the machine and the versions
"$venv/bin/python" - "$out" <<'PY'
import json, platform, re, sys
from importlib.metadata import version
from pathlib import Path

out = Path(sys.argv[1])
cpu = Path("/proc/cpuinfo").read_text()
field = lambda name: re.search(rf"^{name}\s*: (.*)$", cpu, re.M).group(1)
runs = [json.loads(line) for line in (out / "ready.jsonl").read_text().splitlines()]
for run in runs:
    log = (out / f"{run['name']}-{run['round']}.log").read_text()
    run["load_line"] = next((line for line in log.splitlines() if ": done in " in line), None)
flags = [f for f in field("flags").split() if f.startswith(("avx", "amx", "vp2"))]
(out / "results.json").write_text(json.dumps({
    "machine": {"cpu": field("model name"), "family": int(field("cpu family")), "model": int(field("model")),
                "flags": flags, "cores": cpu.count("processor\t:"), "python": platform.python_version()},
    "versions": {name: version(name) for name in ("llama_cpp_python", "torch", "transformers")},
    "runs": runs}, indent=1) + "\n")
PY
