"""`python -m benchmarks replicas`: one `specdec-exact serve` against the same app on Ray Serve replicas, under
concurrent clients.

Configurations (each a server process on a loopback port, started and stopped in turn within every round, the order
rotated from round to round so that drift in the machine's load falls on all alike):
  single             specdec-exact serve --threads T               one process, no Ray: what one replica is
  ray-1              specdec-exact serve --replicas 1 --threads T   the same behind Ray Serve: the overhead Ray adds
  ray-2              specdec-exact serve --replicas 2 --threads T   two replicas (on one machine they share its cores)
  single-2x-threads  specdec-exact serve --threads 2T               one process with the cores two replicas would take

Each configuration answers, with the official openai client, greedy and streamed:
  sequential  --sequential requests one after another (one in flight): the latency a request pays alone
  load        --clients clients at once, --requests each: throughput (completion tokens / the phase's wall time)
              and each request's latency, median and 95th percentile
Every answer is compared with single's for the same prompt: routing through Ray must not change an answer.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness import (Server, Setup, add_benchmark, ask, client_of, fmt, load_prompts,
                                measure_and_keep, names, results_header, rotation, specdec_serve)
from specdec_exact import registry
from specdec_exact.bench.runner import save
from specdec_exact.llama_server import ServerProcess

SCHEMA = "specdec-bench-replicas/1"
CONFIGS = ("single", "ray-1", "ray-2", "single-2x-threads")
REFERENCE = "single"
# Ray's shutdown drains the replicas and stops the cluster's processes: give it time before a kill would strand them.
RAY_STOP_TIMEOUT_S = 120.0


def server_of(name: str, target: str, draft: str, threads: int, prompt_cache_mb: float) -> Server:
    cluster = {"ray-1": ("--replicas", "1"), "ray-2": ("--replicas", "2")}.get(name, ())
    threads = 2 * threads if name == "single-2x-threads" else threads
    argv = specdec_serve(Setup(None, target, draft, threads), draft)
    return Server(name, (*argv, "--prompt-cache-mb", f"{prompt_cache_mb:g}", *cluster), token_ids=True)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = add_benchmark(
        subparsers, "replicas", run_command, report, out="bench-replicas-results", llama_server=False,
        help="one specdec-exact serve against Ray Serve replicas of it, under concurrent clients",
        description=__doc__.split("\n\n")[0].rstrip(".")
        + ". Writes results.json and report.md (and the servers' logs).")
    parser.add_argument("--target", default=registry.DEFAULT_TARGET, help="(default: %(default)s)")
    parser.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="(default: %(default)s)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="threads per replica (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (default: %(default)s)")
    parser.add_argument("--sequential", type=int, default=6,
                        help="requests sent one at a time before the load (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--sequential-max-tokens", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--prompt-cache-mb", type=float, default=0,
                        help="every server's --prompt-cache-mb; 0 (default) so that replicas and a single server "
                             "prefill alike and the figures compare decoding capacity")
    return parser


def run_command(args) -> int:
    configs = names(args.configs, CONFIGS, "--configs")
    if min(args.threads, args.clients, args.requests, args.max_tokens, args.sequential_max_tokens, args.rounds) < 1 \
            or args.sequential < 0 or args.startup_timeout <= 0 or args.prompt_cache_mb < 0:
        raise ValueError("--threads, --clients, --requests, --max-tokens, --sequential-max-tokens and --rounds must "
                         "be >= 1, --sequential and --prompt-cache-mb >= 0, --startup-timeout > 0")
    if any(name.startswith("ray") for name in configs):
        if importlib.util.find_spec("ray") is None:  # checked before any server starts
            raise ValueError("the ray-* configurations need Ray Serve: pip install -r requirements-ray.txt")
    servers = [server_of(name, args.target, args.draft, args.threads, args.prompt_cache_mb) for name in configs]
    prompts, warmup = load_prompts()
    out = Path(args.out)
    results = {**results_header(SCHEMA, packages=("ray", "llama_cpp_python", "openai")),
               "settings": {key: getattr(args, key) for key in ("target", "draft", "threads", "clients", "requests",
                                                                "sequential", "max_tokens", "sequential_max_tokens",
                                                                "rounds", "prompt_cache_mb")},
               "servers": {}, "phases": [], "records": []}
    return measure_and_keep(lambda: run(servers, prompts, warmup, args, out, results), results, out, report)


def run(servers: list[Server], prompts: list[dict], warmup: dict, args, out: Path, results: dict) -> dict:
    """Each round, every configuration in turn (the order rotated per round) started, warmed up, sent the requests
    alone and then the load, and stopped; results gains the records and each phase's wall time, saved after each."""
    by_name = {server.name: server for server in servers}
    for round_ in range(args.rounds):
        for server in (by_name[name] for name in rotation(list(by_name), round_)):
            print(f"round {round_ + 1}/{args.rounds}: starting {server.name} ...", file=sys.stderr, flush=True)
            stop = RAY_STOP_TIMEOUT_S if server.name.startswith("ray") else 15.0
            with ServerProcess(server, out / "logs" / f"{server.name}-{round_}.log", args.startup_timeout,
                               stop_timeout=stop) as proc:
                model = proc.model()
                results["servers"].setdefault(server.name, {"command": proc.argv, "model": model,
                                                            "kernel_plan": proc.get_json("/v1/specdec/plan"),
                                                            "startup_s": []})["startup_s"].append(proc.startup_s)

                def request(prompt: dict, max_tokens: int, phase: str) -> dict:
                    # a client of its own per request, each on a new connection
                    record = ask(client_of(proc.url), model, prompt["prompt"], max_tokens, server.token_ids)
                    return {"server": server.name, "round": round_, "phase": phase, "prompt_id": prompt["id"],
                            **record}

                request(warmup, 8, "warmup")  # first passes over cold weights: not measured
                started = time.perf_counter()
                records = [request(prompts[i % len(prompts)], args.sequential_max_tokens, "sequential")
                           for i in range(args.sequential)]
                results["records"] += records
                results["phases"].append(_phase(server.name, round_, "sequential", records, started))
                print(f"{server.name}: {args.clients} clients", file=sys.stderr, flush=True)
                load = [prompts[i % len(prompts)] for i in range(args.clients * args.requests)]
                started = time.perf_counter()
                with ThreadPoolExecutor(args.clients) as pool:  # each client sends its requests one after another
                    per_client = pool.map(
                        lambda c: [request(p, args.max_tokens, "load") for p in load[c::args.clients]],
                        range(args.clients))
                    records = [record for client in per_client for record in client]
                results["records"] += records
                results["phases"].append(_phase(server.name, round_, "load", records, started))
                save(results, out / "results.json")
    return results


def _phase(server: str, round_: int, phase: str, records: list[dict], started: float) -> dict:
    wall = time.perf_counter() - started
    tokens = sum(record["completion_tokens"] or 0 for record in records)
    return {"server": server, "round": round_, "phase": phase, "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall if wall else None}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def summarise(results: dict) -> dict:
    """Per configuration: load throughput (median over rounds), load latency (median and 95th percentile over all
    its requests), time to first token, the latency of a request alone; Ray's overhead per request alone (ray-1's
    median minus single's); answers equal to single's."""
    summary = {}
    records, phases = results["records"], results.get("phases", [])
    reference = {(r["phase"], r["round"], r["prompt_id"]): r["token_ids"] for r in records if r["server"] == REFERENCE}
    for name in dict.fromkeys(r["server"] for r in records):
        mine = [r for r in records if r["server"] == name]
        load = [r["wall_s"] for r in mine if r["phase"] == "load"]
        alone = [r["wall_s"] for r in mine if r["phase"] == "sequential"]
        # what a request alone spends outside the engine (HTTP, the front, Ray's routing): its wall time less the
        # time the server's own stats give to the generation
        outside = [r["wall_s"] - r["server_stats"]["time_s"]["total"] for r in mine
                   if r["phase"] == "sequential" and (r.get("server_stats") or {}).get("time_s")]
        rates = [p["tokens_per_s"] for p in phases if p["server"] == name and p["phase"] == "load"]
        compared = [r["token_ids"] == reference[key] for r in mine
                    if (key := (r["phase"], r["round"], r["prompt_id"])) in reference]
        summary[name] = {
            "load_tokens_per_s": statistics.median(rates) if rates else None,
            "load_latency_median_s": statistics.median(load) if load else None,
            "load_latency_p95_s": _percentile(load, 95),
            "load_first_token_median_s": statistics.median([r["first_token_s"] for r in mine
                                                            if r["phase"] == "load" and r["first_token_s"]] or [0]),
            "alone_latency_median_s": statistics.median(alone) if alone else None,
            "alone_outside_engine_ms": 1000 * statistics.median(outside) if outside else None,
            "same_as_single": f"{sum(compared)}/{len(compared)}"}
    base = summary.get(REFERENCE, {})
    for name, figures in summary.items():
        if base.get("load_tokens_per_s") and figures["load_tokens_per_s"]:
            figures["throughput_vs_single"] = figures["load_tokens_per_s"] / base["load_tokens_per_s"]
        if base.get("alone_latency_median_s") is not None and figures["alone_latency_median_s"] is not None:
            figures["alone_overhead_ms"] = 1000 * (figures["alone_latency_median_s"] - base["alone_latency_median_s"])
    return summary


def report(results: dict) -> str:
    settings, machine = results["settings"], results["machine"]
    lines = [f"# Replicas on Ray Serve: {settings['clients']} clients, {settings['threads']} thread(s) a replica", "",
             f"- command: `{results['command']}`", f"- machine: {machine['cpu']}, {machine['cores']} cores, "
             f"load average at start {machine['load_average_at_start']}", f"- versions: {results['versions']}",
             f"- target {settings['target']}, draft {settings['draft']}; greedy, streamed; load: {settings['clients']} "
             f"clients x {settings['requests']} requests of up to {settings['max_tokens']} tokens; alone: "
             f"{settings['sequential']} requests of up to {settings['sequential_max_tokens']} tokens one at a time; "
             f"{settings['rounds']} rounds; --prompt-cache-mb {settings['prompt_cache_mb']:g}", "",
             "| configuration | load tokens/s (median of rounds) | vs single | latency median / p95 (s) | first token "
             "median (s) | a request alone (s) | overhead alone (ms) | outside the engine alone (ms) | "
             "answers = single's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, f in summarise(results).items():
        lines.append(f"| {name} | {fmt(f['load_tokens_per_s'], 2)} | {fmt(f.get('throughput_vs_single'), 2)}x | "
                     f"{fmt(f['load_latency_median_s'], 2)} / {fmt(f['load_latency_p95_s'], 2)} | "
                     f"{fmt(f['load_first_token_median_s'], 2)} | {fmt(f['alone_latency_median_s'], 2)} | "
                     f"{fmt(f.get('alone_overhead_ms'), 0)} | {fmt(f['alone_outside_engine_ms'], 0)} | "
                     f"{f['same_as_single']} |")
    lines += ["", "Throughput is completion tokens over the load phase's wall time; latency is each request's, "
                  "sending to last token, over every request of every round. The overhead alone is a configuration's "
                  "median latency of a request alone minus single's: for ray-1 what running under Ray costs, the "
                  "generation's own time included (Ray's processes share the machine's cores); outside the engine is "
                  "a request's wall time less the generation time in the server's stats, median: HTTP, and for "
                  "ray-* the front and Ray's routing."]
    return "\n".join(lines) + "\n"

