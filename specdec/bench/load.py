"""`specdec load`: concurrent clients against the OpenAI-compatible server, one request at a time vs batched.

Both servers run in this process over one loaded generator, on loopback; for each client count they take turns
(one-at-a-time, then batched), so that a change in the machine's load falls on both. Every client sends greedy
completions with the official OpenAI client, streaming, and records the time to its first token and its tokens;
every answer is compared with the prompt's own `generate` output. Bounded in time and count: `--clients`,
`--requests` per client, `--max-tokens`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdec.bench.runner import machine_info, save
from specdec.options import add_generation_args, generator_from_args

DEFAULT_CLIENTS = "1,2,4,8,16"
DEFAULT_TASKS = ("code", "summarisation")
MODEL_NAME = "specdec-load"


def add_load_parser(subparsers) -> argparse.ArgumentParser:

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
    parser.add_argument("--out", default="load-results", help="output folder (default: %(default)s)")
    parser.set_defaults(func=run_load_command)
    return parser


def run_load_command(args) -> int:

    from specdec.bench.workloads import TASKS

    clients = _counts(args.clients)
    if args.requests < 1 or args.max_tokens < 1 or args.max_batch < 2:
        raise ValueError("--requests and --max-tokens must be >= 1, --max-batch >= 2")
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    unknown = [task for task in tasks if task not in TASKS]
    if not tasks or unknown:
        raise ValueError(f"--tasks takes some of {', '.join(TASKS)}, separated by commas; got {args.tasks!r}")
    generator = generator_from_args(args)
    prompts = load_prompts(generator, max(clients) * args.requests, tasks)
    results = run_load(generator, prompts, clients, args.requests, args.max_tokens, args.max_batch)
    results["command"] = "specdec " + " ".join(sys.argv[1:])
    results["tasks"] = tasks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save(results, out / "results.json")
    _write(out / "report.md", report(results))
    plot(results, out / "throughput.png")
    print(report(results))
    print(f"wrote {out}/results.json, report.md and throughput.png")
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
    from specdec.bench.workloads import TASKS, select

    def n_tokens(prompt):
        return len(generator.tokenizer(prompt.text)["input_ids"])

    each = -(-count // len(tasks))
    chosen = [select(TASKS[task].load(), each, n_tokens, max_tokens) for task in tasks]
    if not all(chosen):
        empty = [task for task, prompts in zip(tasks, chosen) if not prompts]
        raise ValueError(f"no prompt of {', '.join(empty)} has at most {max_tokens} tokens")
    mixed = [p.text for group in zip(*chosen) for p in group]
    return [mixed[i % len(mixed)] for i in range(count)]


def run_load(generator, prompts: list[str], clients: list[int], requests: int, max_tokens: int,
             max_batch: int) -> dict:
    from specdec.server import create_app

    references = {}
    for prompt in dict.fromkeys(prompts):  # each prompt's own greedy output, once
        references[prompt] = generator.generate(prompt, max_new_tokens=max_tokens, chat=True).text
    servers = {"one at a time": create_app(generator, MODEL_NAME, max_queue=256, max_batch=1),
               f"batched (max {max_batch})": create_app(generator, MODEL_NAME, max_queue=256, max_batch=max_batch)}
    rows = []
    rss_before = _rss_mb()
    with _Serving(servers) as urls:
        for n in clients:
            for label, url in urls.items():
                with _PeakRss() as memory:
                    row = _drive(url, prompts[: n * requests], references, n, max_tokens)
                rows.append({"server": label, "clients": n, **row, "peak_rss_mb": memory.peak_mb})
                print(f"{label}, {n} clients: {row['tokens_per_s']:.1f} tokens/s, median TTFT "
                      f"{row['ttft_median_s']:.2f} s, identical {row['identical']}/{row['requests']}, failed "
                      f"{row['failed']}, peak RSS {memory.peak_mb:.0f} MB", file=sys.stderr)
    return {"max_tokens": max_tokens, "requests_per_client": requests, "rows": rows, "machine": machine_info(),
            "rss_before_mb": rss_before}


def _drive(url: str, prompts: list[str], references: dict[str, str], clients: int, max_tokens: int) -> dict:
    """`clients` threads, each sending its share of prompts one after another."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    queues = [prompts[i::clients] for i in range(clients)]

    def one_client(own: list[str]) -> list[dict]:
        done = []
        for prompt in own:
            sent = time.perf_counter()
            first, text, usage, error = None, [], None, None
            try:
                for chunk in client.chat.completions.create(
                        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                        temperature=0, stream=True, stream_options={"include_usage": True}):
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        text.append(chunk.choices[0].delta.content)
                    usage = chunk.usage or usage
            except openai.OpenAIError as failure:  # counted, not fatal: "no request fails" is what is measured
                error = f"{type(failure).__name__}: {failure}"
            done.append({"ttft_s": (first or time.perf_counter()) - sent, "s": time.perf_counter() - sent,
                         "tokens": usage.completion_tokens if usage else 0, "error": error,
                         "identical": error is None and "".join(text) == references[prompt]})
        return done

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one_client, queues) for r in rs]
    wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in results),
            "ttft_max_s": max(r["ttft_s"] for r in results),
            "latency_max_s": max(r["s"] for r in results),
            "identical": sum(r["identical"] for r in results),
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
        import socket

        import uvicorn

        urls = {}
        for label, app in self.apps.items():
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
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
    lines = ["# specdec load test", "",
             f"Command: `{results.get('command', 'specdec load')}`  ",
             f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores  ",
             f"Prompts: {', '.join(results.get('tasks', DEFAULT_TASKS))}, in turn  ",
             f"Each client sends {results['requests_per_client']} greedy chat completion(s), one after another "
             f"(streaming, {results['max_tokens']} tokens at most); the two servers take turns at each client count. "
             f"Resident memory of the process before the first run: {results.get('rss_before_mb', 0):.0f} MB "
             "(models loaded, each prompt's reference generated).",
             "", "| clients | server | tokens/s (all clients) | vs one at a time | median TTFT (s) | max TTFT (s) | "
             "max latency (s) | identical to generate | failed | peak RSS (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    single = {r["clients"]: r["tokens_per_s"] for r in rows if r["server"] == "one at a time"}
    for r in rows:
        lines.append(f"| {r['clients']} | {r['server']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / single[r['clients']]:.2f}x | {r['ttft_median_s']:.2f} | "
                     f"{r['ttft_max_s']:.2f} | {r['latency_max_s']:.1f} | {r['identical']}/{r['requests']} | "
                     f"{r.get('failed', 0)} | {r.get('peak_rss_mb', 0):.0f} |")
    errors = sorted({e for r in rows for e in r.get("errors", [])})
    return "\n".join(lines + (["", "Errors: " + "; ".join(errors)] if errors else [])) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for server in dict.fromkeys(r["server"] for r in results["rows"]):
        points = [(r["clients"], r["tokens_per_s"]) for r in results["rows"] if r["server"] == server]
        axes.plot(*zip(*points), marker="o", label=server)
    counts = sorted({r["clients"] for r in results["rows"]})
    axes.set_xscale("log", base=2)
    axes.set_xticks(counts, [str(n) for n in counts])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("tokens/s, all clients")
    axes.set_title("specdec serve: throughput")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    partial = path.with_name(path.name + ".partial.png")
    figure.savefig(partial)
    plt.close(figure)
    partial.replace(path)


def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
