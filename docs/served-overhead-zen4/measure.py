"""Per-token time outside the target's passes, served: `specdec serve --draft none` of each checkout given (started
from it, in turn on one port each), six prompts (chat, maths, translation of the servers benchmark) streamed to every
server in turn, ROUNDS times; from each response's own stats (`return_speculation_stats`): milliseconds a token
outside the prefill, and a verify pass's milliseconds. Usage (from the repository, its .venv):
.venv/bin/python docs/served-overhead-zen4/measure.py OUT ROUNDS NAME=REPO [NAME=REPO ...]"""

import json
import platform
import re
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = "qwen2.5-coder-1.5b-instruct"
KINDS = ("chat", "maths", "translation")


def ask(port: int, prompt: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 128, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_speculation_stats": True}
    stats = None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stats = json.loads(line[6:]).get("specdec") or stats
    return stats


def main(out: Path, rounds: int, checkouts: dict[str, Path]) -> None:
    prompts = [p for p in json.loads((ROOT / "benchmarks/data/server_prompts.json").read_text())["prompts"]
               if p["kind"] in KINDS]
    out.mkdir(parents=True, exist_ok=True)
    servers, ports = {}, {}
    try:
        for i, (name, repo) in enumerate(checkouts.items()):
            ports[name] = 8441 + i
            log = (out / f"{name}.log").open("w")
            servers[name] = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--draft", "none", "--port",
                                              str(ports[name])], cwd=repo, stdout=log, stderr=subprocess.STDOUT)
        for name, port in ports.items():
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if servers[name].poll() is not None:
                    raise SystemExit(f"{name}'s server ended: see {out / (name + '.log')}")
                time.sleep(0.5)
            ask(port, "Say hello.")  # (warm-up, not measured)
        records = []
        for round_ in range(rounds):
            for prompt in prompts:
                for name, port in ports.items():
                    stats = ask(port, prompt["prompt"])
                    spent = stats["time_s"]
                    records.append({"server": name, "round": round_, "prompt_id": prompt["id"],
                                    "ms_per_token": 1000 * (spent["total"] - spent["prefill"]) / stats["new_tokens"],
                                    "verify_ms_per_pass": 1000 * spent["verify"] / stats["target_calls"],
                                    "stats": stats})
    finally:
        for server in servers.values():
            server.terminate()
            server.wait()
    summary = {}
    for name in checkouts:
        mine = [r for r in records if r["server"] == name]
        per_token = statistics.median(r["ms_per_token"] for r in mine)
        per_pass = statistics.median(r["verify_ms_per_pass"] for r in mine)
        summary[name] = {"commit": subprocess.run(["git", "-C", str(checkouts[name]), "rev-parse", "--short", "HEAD"],
                                                  capture_output=True, text=True).stdout.strip(),
                         "median_ms_per_token": round(per_token, 3), "median_verify_ms_per_pass": round(per_pass, 3),
                         "outside_passes_ms_per_token": round(per_token - per_pass, 3)}
        print(name, summary[name])
    cpu = Path("/proc/cpuinfo").read_text()
    field = lambda key: re.search(rf"^{key}\s*: (.*)$", cpu, re.M).group(1)  # noqa: E731
    machine = {"cpu": field("model name"), "family": int(field("cpu family")), "model": int(field("model")),
               "flags": [f for f in field("flags").split() if f.startswith(("avx", "amx", "vp2"))],
               "cores": cpu.count("processor\t:"), "python": platform.python_version()}
    (out / "results.json").write_text(json.dumps({
        "command": " ".join(["python", *sys.argv]), "machine": machine,
        "versions": {n: version(n) for n in ("llama_cpp_python", "torch", "transformers")},
        "summary": summary, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), {a.split("=", 1)[0]: Path(a.split("=", 1)[1]).resolve()
                                                 for a in sys.argv[3:]})
