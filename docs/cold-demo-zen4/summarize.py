"""results.json beside the cold runs' logs: each run's phases, total, demo figures, machine, versions and kernel plan,
read from X-demo.log and X-machine.txt (run.sh's output) and flags.txt.

    python3 docs/cold-demo-zen4/summarize.py
"""

import json
import re
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).parent


def seconds(start: str, end: str) -> int:
    return int((datetime.strptime(end, "%H:%M:%S") - datetime.strptime(start, "%H:%M:%S")).total_seconds())


def first(log: str, pattern: str) -> re.Match:
    found = re.search(pattern, log, re.MULTILINE)
    if found is None:
        raise ValueError(f"not in the log: {pattern}")
    return found


def run(name: str) -> dict:
    log = (HERE / f"{name}-demo.log").read_text()
    started, cpu, family, model, cores, code = (HERE / f"{name}-machine.txt").read_text().splitlines()[:6]
    start = started[11:19]
    stamp = lambda pattern: first(log, rf"^(\d\d:\d\d:\d\d) {pattern}").group(1)  # noqa: E731
    installed, wheel = stamp(r"touch \.venv/\.installed"), stamp(r"touch \.venv/\.llama-cpp")
    calibrating, calibrated = stamp(r"\.venv/bin/specdec calibrate$"), stamp(r"touch \.venv/\.calibrated-")
    peer = first(log, r"^\S+ (upstream llama-server|plain llama\.cpp)[^:]*: ([\d.]+) tokens/s")
    record = {
        "code": code.split()[0], "started_at": started,
        "machine": {"cpu": cpu.split(":", 1)[1].strip(), "family": family.split(":", 1)[1].strip(),
                    "model": model.split(":", 1)[1].strip(), "cores": int(cores),
                    "flags": (HERE / "flags.txt").read_text().split()},
        "versions": {"llama-cpp-python": first(log, r"llama-cpp-python==([\d.]+)").group(1),
                     "llama-server": "built from the same source, unpatched (make llama-server)"},
        "kernel_plans": {"target": first(log, r"kernel plan \(target, passes of 1-16 tokens\): (.*)$").group(1)},
        "seconds": {"packages": seconds(start, installed), "wheel": seconds(installed, wheel),
                    "calibration": seconds(calibrating, calibrated), "demo": seconds(calibrated, stamp(r"\tExit status")),
                    "total": int(first(log, r"^exit 0 after (\d+) s").group(1))},
        "demo_tokens_per_s": {"specdec": float(first(log, r"in turn: specdec ([\d.]+) tokens/s").group(1)),
                              "target_only": float(first(log, r"target-only: ([\d.]+) tokens/s").group(1)),
                              "llama_server" if peer.group(1).startswith("upstream") else "llama_cpp_loop":
                                  float(peer.group(2))},
        "identical_output": "(identical output)" in log,
        "peak_rss_kb": int(first(log, r"Maximum resident set size \(kbytes\): (\d+)").group(1)),
    }
    if name == "a":  # llama-server built beside the wheel
        record["seconds"]["llama_server"] = seconds(installed, stamp(r"version: "))
    return record


if __name__ == "__main__":
    results = {"command": "docs/cold-demo-zen4/run.sh ROOT REPO", "runs": {name: run(name) for name in "ab"}}
    partial = HERE / ".results.json.partial"
    partial.write_text(json.dumps(results, indent=1) + "\n")
    partial.replace(HERE / "results.json")
    print(json.dumps({name: r["seconds"] for name, r in results["runs"].items()}))
