"""`python -m benchmarks load`: concurrent clients against the OpenAI-compatible server, one request at a time vs
batched.

Both servers run in this process over one loaded generator, on loopback; for each client count they take turns
(one-at-a-time, then batched), so that a change in the machine's load falls on both. Every client sends greedy
completions with the official OpenAI client, streaming, starting at a random offset (--stagger, so that requests
arrive at other moments of each other's decoding in every round), and records the time to its first token and its
tokens; every answer is compared token for token with the prompt's own `generate` output: batching must not change
what a request gets. Bounded in time and count: `--clients`, `--requests` per client, `--rounds`, `--max-tokens`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness import client_of, command_line, names, write
from specdec_exact.bench.runner import machine_info, pyplot, save
from specdec_exact.llama_server import free_port, openai_module
from specdec_exact.options import add_generation_args, generator_from_args

DEFAULT_CLIENTS = "1,2,4,8,16"
DEFAULT_TASKS = ("code", "summarisation")
MODEL_NAME = "specdec-load"


def add_parser(subparsers) -> argparse.ArgumentParser:

    parser = subparsers.add_parser(
        "load", help="load-test the server: concurrent clients, one request at a time vs batched",
        description="Start the server twice in this process (--max-batch 1 and --max-batch N) over one loaded "
                    "generator and drive each with 1, 2, 4, ... concurrent streaming clients (the OpenAI client, "
                    "greedy); report aggregate tokens/s, time to first token and whether every answer equals the "
                    "prompt's own generate output. Writes results.json, report.md and throughput.png.")
    add_generation_args(parser)
    parser.add_argument("--clients", default=DEFAULT_CLIENTS, help="client counts (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                        help="comma-separated packaged workloads whose prompts the clients send, in turn: code, "
                             "summarisation (both copy from their input: lookup drafts pay), maths (it does not) "
                             "(default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=8, help="the batched server's --max-batch (default: "
                                                                "%(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=160,
                        help="the longest prompt taken from the workloads, in tokens (default: %(default)s)")
    parser.add_argument("--stagger", type=float, default=2.0,
                        help="each client starts at a random moment in the first this many seconds (default: "
                             "%(default)s)")
    parser.add_argument("--only-batched", action="store_true",
                        help="drive only the batched server (no one-at-a-time run to compare throughput with): "
                             "for checking, round after round, that batching changes no answer")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each server takes the load at each client count, with new start offsets "
                             "(default: %(default)s)")
    parser.add_argument("--out", default="load-results", help="output folder (default: %(default)s)")
    parser.set_defaults(func=run_load_command)
    return parser


def run_load_command(args) -> int:

    from specdec_exact.bench.workloads import TASKS

    clients = _counts(args.clients)
    if min(args.requests, args.max_tokens, args.rounds, args.max_prompt_tokens) < 1 or args.max_batch < 2:
        raise ValueError("--requests, --rounds, --max-tokens and --max-prompt-tokens must be >= 1, --max-batch >= 2")
    if args.stagger < 0:
        raise ValueError(f"--stagger must be >= 0 seconds, got {args.stagger}")
    tasks = names(args.tasks, TASKS, "--tasks")
    generator = generator_from_args(args)
    prompts = load_prompts(generator, max(clients) * args.requests, tasks, args.max_prompt_tokens)
    results = run_load(generator, prompts, clients, args.requests, args.max_tokens, args.max_batch,
                       stagger=args.stagger, rounds=args.rounds, one_at_a_time=not args.only_batched)
    results["command"] = command_line()
    results["tasks"] = tasks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save(results, out / "results.json")
    write(out / "report.md", report(results))
    plotted = plot(results, out / "throughput.png")
    print(report(results))
    print(f"wrote {out}/results.json, report.md" + (" and throughput.png" if plotted else ""))
    return 0


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--clients takes positive numbers separated by commas, got {text!r}")
    return counts


def load_prompts(generator, count: int, tasks=DEFAULT_TASKS, max_tokens: int = 160) -> list[str]:
    """`count` real prompts of the packaged workloads' tasks, taken in turn: each task's first prompts of at most
    max_tokens tokens (short enough for 2 cores)."""
    from specdec_exact.bench.workloads import TASKS, select

    def n_tokens(prompt):
        return len(generator.tokenizer(prompt.text)["input_ids"])

    each = -(-count // len(tasks))
    chosen = [select(TASKS[task].load(), each, n_tokens, max_tokens) for task in tasks]
    if not all(chosen):
        empty = [task for task, prompts in zip(tasks, chosen) if not prompts]
        raise ValueError(f"no prompt of {', '.join(empty)} has at most {max_tokens} tokens")
    mixed = [p.text for group in zip(*chosen) for p in group]
    return [mixed[i % len(mixed)] for i in range(count)]


def run_load(generator, prompts: list[str], clients: list[int], requests: int, max_tokens: int, max_batch: int,
             stagger: float = 0.0, rounds: int = 1, one_at_a_time: bool = True,
             references: dict[str, list[int]] | None = None) -> dict:
    """Each client count, `rounds` times: the one-at-a-time server (unless one_at_a_time is False), then the batched
    one, each driven by that many clients with `requests` prompts each -> the results, a row per server, count and
    round. Every answer is checked token for token against the prompt's own generate() output (or references: the
    token ids of each prompt's greedy chat answer, made by another generator of the same target)."""
    from specdec_exact.server import create_app

    if references is None:
        references = {prompt: generator.generate(prompt, max_new_tokens=max_tokens, chat=True).token_ids
                      for prompt in dict.fromkeys(prompts)}  # each prompt's own greedy output, once
    servers = {f"batched (max {max_batch})": create_app(generator, MODEL_NAME, max_queue=256, max_batch=max_batch)}
    if one_at_a_time:
        servers = {"one at a time": create_app(generator, MODEL_NAME, max_queue=256, max_batch=1), **servers}
    rows = []
    rss_before = _rss_mb()
    with _Serving(servers) as urls:
        for n in clients:
            for round_ in range(rounds):
                for label, url in urls.items():
                    with _PeakRss() as memory:
                        row = _drive(url, prompts[: n * requests], references, n, max_tokens, stagger,
                                     seed=round_)
                    rows.append({"server": label, "clients": n, "round": round_, **row,
                                 "peak_rss_mb": memory.peak_mb})
                    print(f"{label}, {n} clients, round {round_ + 1}: {row['tokens_per_s']:.1f} tokens/s, median "
                          f"TTFT {row['ttft_median_s']:.2f} s, identical {row['identical']}/{row['requests']}, "
                          f"failed {row['failed']}, peak RSS {memory.peak_mb:.0f} MB", file=sys.stderr)
    return {"max_tokens": max_tokens, "requests_per_client": requests, "stagger_s": stagger, "rounds": rounds,
            "rows": rows, "machine": machine_info(), "rss_before_mb": rss_before}


def _drive(url: str, prompts: list[str], references: dict[str, list[int]], clients: int, max_tokens: int,
           stagger: float = 0.0, seed: int = 0) -> dict:
    """`clients` threads, each starting at a random moment in the first `stagger` seconds and sending its share of
    prompts one after another; each answer's token ids are compared with references[prompt]."""
    import random

    openai = openai_module()
    client = client_of(url, timeout=600)
    queues = [prompts[i::clients] for i in range(clients)]
    offsets = [random.Random(f"{seed}/{i}").uniform(0, stagger) for i in range(clients)]

    def one_client(own: list[str], offset: float) -> list[dict]:
        time.sleep(offset)
        done = []
        for prompt in own:
            sent = time.perf_counter()
            first, tokens, usage, error = None, [], None, None
            try:
                for chunk in client.chat.completions.create(
                        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                        temperature=0, stream=True, stream_options={"include_usage": True},
                        extra_body={"return_token_ids": True}):
                    if chunk.choices:
                        if chunk.choices[0].delta.content:
                            first = first or time.perf_counter()
                        tokens += getattr(chunk.choices[0], "token_ids", None) or []
                    usage = chunk.usage or usage
            except openai.OpenAIError as failure:  # counted, not fatal: "no request fails" is what is measured
                error = f"{type(failure).__name__}: {failure}"
            done.append({"prompt": prompt, "ttft_s": (first or time.perf_counter()) - sent,
                         "s": time.perf_counter() - sent, "tokens": usage.completion_tokens if usage else 0,
                         "error": error, "identical": error is None and tokens == references[prompt]})
        return done

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one_client, queues, offsets) for r in rs]
    wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in results),
            "ttft_max_s": max(r["ttft_s"] for r in results),
            "latency_max_s": max(r["s"] for r in results),
            "identical": sum(r["identical"] for r in results),
            "different": sorted({r["prompt"][:60] for r in results if r["error"] is None and not r["identical"]}),
            "failed": sum(r["error"] is not None for r in results),
            "errors": sorted({r["error"] for r in results if r["error"]})}


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class _PeakRss:
    """The peak resident memory of this process while the block runs, sampled every 0.1 s in a thread."""

    def __enter__(self) -> _PeakRss:
        self.peak_mb, self._done = _rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.peak_mb = max(self.peak_mb, _rss_mb())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, _rss_mb())


class _Serving:
    """uvicorn servers on free loopback ports, each in a thread of its own, stopped on exit."""

    def __init__(self, apps: dict):
        self.apps = apps
        self.servers, self.threads = [], []

    def __enter__(self) -> dict[str, str]:
        import uvicorn

        urls = {}
        for label, app in self.apps.items():
            port = free_port()
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            self.servers.append(server)
            self.threads.append(thread)
            urls[label] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not all(server.started for server in self.servers):
            if time.monotonic() > deadline:
                raise RuntimeError("the load-test servers did not start within 30 s")
            time.sleep(0.05)
        return urls

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.should_exit = True
        for thread in self.threads:
            thread.join(timeout=30)


def report(results: dict) -> str:
    rows = results["rows"]
    identical, answered = sum(r["identical"] for r in rows), sum(r["requests"] - r["failed"] for r in rows)
    lines = ["# specdec load test", "",
             f"Command: `{results.get('command', 'specdec load')}`  ",
             f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores  ",
             f"Prompts: {', '.join(results.get('tasks', DEFAULT_TASKS))}, in turn  ",
             f"Each client sends {results['requests_per_client']} greedy chat completion(s), one after another "
             f"(streaming, {results['max_tokens']} tokens at most), starting at a random moment in the first "
             f"{results.get('stagger_s', 0):g} s; the servers take turns at each client count, "
             f"{results.get('rounds', 1)} round(s) each. Resident memory of the process before the first run: "
             f"{results.get('rss_before_mb', 0):.0f} MB (models loaded, each prompt's reference generated).", "",
             f"**Answers identical to generate(), token for token: {identical}/{answered}.**", "",
             "| clients | round | server | identical to generate | tokens/s (all clients) | vs one at a time | "
             "median TTFT (s) | max TTFT (s) | max latency (s) | failed | peak RSS (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    single = {(r["clients"], r.get("round", 0)): r["tokens_per_s"] for r in rows if r["server"] == "one at a time"}
    for r in rows:
        alone = single.get((r["clients"], r.get("round", 0)))
        ratio = f"{r['tokens_per_s'] / alone:.2f}x" if alone else "-"
        lines.append(f"| {r['clients']} | {r.get('round', 0) + 1} | {r['server']} | {r['identical']}/{r['requests']} "
                     f"| {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['ttft_median_s']:.2f} | {r['ttft_max_s']:.2f} | {r['latency_max_s']:.1f} | "
                     f"{r.get('failed', 0)} | {r.get('peak_rss_mb', 0):.0f} |")
    different = sorted({prompt for r in rows for prompt in r.get("different", [])})
    errors = sorted({e for r in rows for e in r.get("errors", [])})
    return "\n".join(lines + (["", "Answers that differed from generate(): " + "; ".join(different)] if different
                              else []) + (["", "Errors: " + "; ".join(errors)] if errors else [])) + "\n"


def plot(results: dict, path: Path) -> bool:
    """The throughput plot into path -> whether it was written (not where matplotlib is not installed)."""
    plt = pyplot()
    if plt is None:
        return False

    figure, axes = plt.subplots(figsize=(6, 4))
    for server in dict.fromkeys(r["server"] for r in results["rows"]):
        counts = sorted({r["clients"] for r in results["rows"] if r["server"] == server})
        medians = [statistics.median(r["tokens_per_s"] for r in results["rows"]
                                     if r["server"] == server and r["clients"] == n) for n in counts]
        axes.plot(counts, medians, marker="o", label=server)
    counts = sorted({r["clients"] for r in results["rows"]})
    axes.set_xscale("log", base=2)
    axes.set_xticks(counts, [str(n) for n in counts])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("tokens/s, all clients")
    axes.set_title("specdec-exact serve: throughput")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    partial = path.with_name(path.name + ".partial.png")
    figure.savefig(partial)
    plt.close(figure)
    partial.replace(path)
    return True
