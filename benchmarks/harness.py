"""The harness every benchmark of servers runs on: the servers' processes, the client, the schedule, the records and
the report's pieces. A benchmark keeps only what is its own: which servers, what it sends, its figures and its report.

Setup, Server       what a server's command line is made of; a server under test (a
                    specdec_exact.llama_server.ServerCommand that says whether it is a llama-server baseline and
                    whether its answers carry token ids)
specdec_serve, llama_server_argv, llama_server   the command lines of the servers under test
load_prompts        the chat prompts of six kinds (data/server_prompts.json) and the warm-up prompt
start_servers, serving   each server started in turn (its log in out/logs), connected, recorded, warmed up
ask, Running        one greedy chat completion, streamed and timed; a started server that sends it
rotation, schedule, each_turn   the interleaved order: every server in turn, the order rotated from turn to turn
results_header, measure_and_keep, rerender   results.json (machine, CPU, versions) and report.md, kept on a failure
add_benchmark, setup_of, names   a benchmark's subcommand, with the options the benchmarks share
median, fmt, table  the report's figures and tables
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from specdec_exact import DISTRIBUTION, registry
from specdec_exact.bench.runner import machine_info, save, version_of
from specdec_exact.llama_server import (LLAMA_SERVER_FALLBACK, PORT, ServerCommand, ServerError, ServerProcess,
                                        default_llama_server, openai_module)
from specdec_exact.llama_server import llama_server_argv as _llama_server_argv

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "server_prompts.json"
KINDS = ("code-edit", "document-qa", "chat", "maths", "translation", "summary")
# A pause after each measured request (a turn, a burst) before the next server's: a server may go on working a moment
# after its answer is out (specdec keeps a chat answer for the conversation's next turn, a pass of 44-53 ms on a
# 2-core Zen 4: Batch.keep_answers), which the next request, to another server, must not pay for. The same for every
# server, and outside every timing.
SETTLE_S = 0.5


@dataclass(frozen=True)
class Setup:
    """What every server command line is made of."""
    llama_server: Path | None  # None: a run of specdec's servers alone
    target: str  # registry name or .gguf file
    draft: str
    threads: int
    concurrent: int = 1  # requests in flight at once: llama-server's slots (-np), specdec's --max-batch

    def gguf(self, name: str) -> str:
        return name if name.endswith(".gguf") else str(registry.gguf_file(name))


@dataclass(frozen=True)
class Server(ServerCommand):
    """One server under test: its command line (PORT for its port), and how its answers are read."""
    baseline: bool = False  # a llama-server configuration: specdec's servers are compared with the best of these
    token_ids: bool = False  # answers carry their token ids when the request asks (specdec's return_token_ids)


def llama_server_argv(setup: Setup, *extra: str) -> tuple[str, ...]:
    """llama-server on the setup's target with as many slots as it has clients, these extra arguments after."""
    return _llama_server_argv(setup.llama_server, setup.gguf(setup.target), setup.threads, *extra,
                              slots=setup.concurrent)


def llama_server(name: str, setup: Setup, *extra: str) -> Server:
    """llama-server as a baseline under test: the target, these extra arguments, and the fallback for CPUs where its
    defaults crash."""
    return Server(name, llama_server_argv(setup, *extra), baseline=True, fallback=LLAMA_SERVER_FALLBACK)


def specdec_serve(setup: Setup, draft: str) -> tuple[str, ...]:
    """specdec-exact serve's command line with this draft; --max-batch where more than one client sends at once."""
    batch = ("--max-batch", str(setup.concurrent)) if setup.concurrent > 1 else ()  # else its default
    return (sys.executable, "-m", "specdec_exact.cli", "serve", "--target", setup.target, "--draft", draft, "--threads",
            str(setup.threads), *batch, "--host", "127.0.0.1", "--port", PORT)


def load_prompts(kinds: tuple[str, ...] = KINDS) -> tuple[list[dict], dict]:
    """The chat prompts of the given kinds, in file order, and the warm-up prompt (never measured)."""
    data = json.loads(PROMPTS_FILE.read_text())
    return [p for p in data["prompts"] if p["kind"] in kinds], data["warmup"]


# ---- the client


def client_of(url: str, api_key: str = "unused", timeout: float = 1800):
    """An OpenAI client of the server at url: no retries (a failed request is recorded as it failed)."""
    return openai_module().OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


# What a specdec server is asked for beside the answer (token_ids): each choice's token ids and the speculation stats.
SPECDEC_FIELDS = {"return_token_ids": True, "return_speculation_stats": True}


def ask(client, model: str, prompt: str | list[dict], max_tokens: int, token_ids: bool,
        arrivals: list[float] | None = None, extra_body: dict | None = None) -> dict:
    """One greedy chat completion of a user message (or of chat messages), streamed -> the measured record: wall time
    from sending to the whole answer (prefill included), time to the first token, the decode rate after it (the
    tokens after the first over the time after it), which is what per-token overhead shows in, and the prompt tokens
    the server took from its prompt cache, where it says. arrivals: gains the time.perf_counter() of each chunk of
    text as it comes (another thread may watch it grow). extra_body: more fields of the request body. token_ids (a
    specdec server): the answer's token ids and speculation stats are asked for too (SPECDEC_FIELDS)."""
    started = time.perf_counter()
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={**(SPECDEC_FIELDS if token_ids else {}), **(extra_body or {})} or None)
    texts, ids, first_s, finish, usage, stats = [], [], None, None, None, None
    for chunk in stream:
        extra = chunk.model_extra or {}
        stats = extra.get("timings") or extra.get("specdec") or stats  # the server's own account, where it gives one
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content or ""
            if piece and first_s is None:
                first_s = time.perf_counter() - started
            if piece and arrivals is not None:
                arrivals.append(time.perf_counter())
            texts.append(piece)
            ids += getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
    wall_s = time.perf_counter() - started
    completion = usage.completion_tokens if usage is not None else None
    details = getattr(usage, "prompt_tokens_details", None)
    cached = details.cached_tokens if details is not None else (stats or {}).get("cache_n")  # llama-server: timings
    decode_s = wall_s - first_s if first_s is not None else None
    return {"prompt_tokens": usage.prompt_tokens if usage is not None else None, "completion_tokens": completion,
            "wall_s": wall_s, "tokens_per_s": completion / wall_s if completion else 0.0, "first_token_s": first_s,
            "decode_tokens_per_s": (completion - 1) / decode_s if completion and completion > 1 and decode_s else None,
            "finish_reason": finish, "text": "".join(texts), "token_ids": ids if token_ids else None,
            "cached_tokens": cached,
            "server_stats": stats}


class Running(NamedTuple):
    """A server under test, started: its process, an OpenAI client of it and its model's id."""
    server: Server
    process: ServerProcess
    client: object
    model: str

    def ask(self, prompt: str | list[dict], max_tokens: int, **options) -> dict:
        """ask() of this server, its token ids asked for where it gives them."""
        return ask(self.client, self.model, prompt, max_tokens, self.server.token_ids, **options)

    def request(self, prompt: dict, max_tokens: int) -> dict:
        """ask() of a prompt of load_prompts, a failed request recorded rather than raised; a server that died on it
        stops the run."""
        openai = openai_module()
        try:
            return self.ask(prompt["prompt"], max_tokens)
        except openai.OpenAIError as error:
            self.process.check_alive()
            return {"error": f"{type(error).__name__}: {error}"}


# ---- the servers


def start_servers(stack: contextlib.ExitStack, servers: list[Server], out: Path, startup_timeout: float,
                  results: dict) -> dict[str, Running]:
    """Start each server in turn, its log in out/logs, each stopped when `stack` closes -> name -> Running;
    results["servers"] gains each one's command line, model, start-up time, fallback and kernel plan."""
    running = {}
    for server in servers:
        print(f"starting {server.name} ...", file=sys.stderr, flush=True)
        proc = stack.enter_context(ServerProcess(server, out / "logs" / f"{server.name}.log", startup_timeout))
        running[server.name] = Running(server, proc, client_of(proc.url), proc.model())
        results.setdefault("servers", {})[server.name] = {
            "command": proc.argv, "baseline": server.baseline, "model": running[server.name].model,
            "startup_s": proc.startup_s, "fallback": proc.fallback,
            # a hook: the kernel plan of specdec's runtime, where the server publishes it
            "kernel_plan": None if server.baseline else proc.get_json("/v1/specdec/plan")}
        print(f"{server.name} ready in {proc.startup_s:.1f} s", file=sys.stderr, flush=True)
    return running


@contextlib.contextmanager
def serving(servers: list[Server], out: Path, startup_timeout: float, results: dict, warmup: dict,
            warmup_tokens: int = 16):
    """start_servers(), then each one's first passes over cold weights on the warm-up prompt (not measured); yields
    name -> Running. The servers are stopped however the block ends."""
    with contextlib.ExitStack() as stack:
        running = start_servers(stack, servers, out, startup_timeout, results)
        for server in running.values():
            server.request(warmup, warmup_tokens)
            time.sleep(SETTLE_S)
        yield running


# ---- the schedule


def rotation(names: list[str], shift: int) -> list[str]:
    """The names in turn, starting at the shift-th (rotated by one from one turn to the next, no server always goes
    first, after a cold cache, or last)."""
    shift %= len(names)
    return names[shift:] + names[:shift]


def schedule(prompts: list[dict], servers: list[str], rounds: int) -> list[tuple[int, dict, list[str]]]:
    """(round, prompt, server order) for every prompt of every round: every server answers the prompt in turn, the
    order rotated by one from one prompt to the next."""
    return [(round_, prompt, rotation(servers, round_ * len(prompts) + i))
            for round_ in range(rounds) for i, prompt in enumerate(prompts)]


def each_turn(names: list[str], rounds: int, unit: str, results: dict, path: Path):
    """(round, server name) for every round and every server in turn, the order rotated per round, with a progress
    bar counting `unit`s; results are saved to path after each turn."""
    from tqdm import tqdm

    with tqdm(total=rounds * len(names), unit=unit, file=sys.stderr, dynamic_ncols=True) as bar:
        for round_ in range(rounds):
            for name in rotation(names, round_):
                bar.set_description(f"round {round_ + 1} {name}")
                yield round_, name
                save(results, path)
                bar.update()
                time.sleep(SETTLE_S)


# ---- results.json and report.md


def command_line() -> str:
    """The command this run was started with, as it is recorded."""
    return shlex.join(["python", "-m", "benchmarks", *sys.argv[1:]])


def results_header(schema: str, setup: Setup | None = None, packages: tuple[str, ...] = ("llama-cpp-python",)) -> dict:
    """What every benchmark's results.json opens with: the schema, the start, the command, the machine (its CPU, its
    load), the versions of specdec and of `packages`, and (setup) the llama-server binary."""
    header = {"schema": schema, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command_line(),
              "machine": machine_info(),
              "versions": {"specdec": version_of(DISTRIBUTION), **{name: version_of(name) for name in packages}}}
    if setup is not None:
        header["llama_server"] = describe_binary(setup.llama_server)
    return header


def measure_and_keep(measure: Callable[[], object], results: dict, out: Path, report: Callable[[dict], str]) -> int:
    """Run a benchmark of servers -> the exit code. A `kill` stops it (and so its servers) as Ctrl-C does, and what
    it measured before an error or an interrupt is saved in out/results.json with its report.md."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        measure()
    except ServerError as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
        results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
        if results["records"]:
            save(results, out / "results.json")
            write(out / "report.md", report(results))
    print((out / "report.md").read_text())
    print(f"wrote {out}/results.json and {out}/report.md (server logs in {out}/logs)")
    return 0


def rerender(results_json: Path, report: Callable[[dict], str]) -> int:
    """Write report.md again beside a finished run's results.json, measuring nothing, and show it."""
    write(results_json.with_name("report.md"), report(json.loads(results_json.read_text())))
    print(results_json.with_name("report.md").read_text())
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def describe_binary(binary: Path | None) -> dict | None:
    """The llama-server binary of a run as results.json records it: its path and its --version (None: none ran)."""
    if binary is None:
        return None
    try:
        shown = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        version = " ".join((shown.stdout + shown.stderr).split()) or None
    except (OSError, subprocess.TimeoutExpired):
        version = None
    return {"path": str(binary), "version": version}


def write(path: Path, text: str) -> None:
    """Write a text file whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    os.replace(partial, path)


def median(values: list) -> float | None:
    """The median of the values that are not None (None: there are none)."""
    import statistics

    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


# ---- the options


def add_benchmark(subparsers, name: str, run: Callable[[argparse.Namespace], int], report: Callable[[dict], str],
                  out: str, llama_server: bool = True, **options) -> argparse.ArgumentParser:
    """The subcommand of a benchmark of servers -> its parser, for the benchmark's own options: the shared ones are
    in (add_common_arguments, or add_run_arguments alone where no llama-server runs), --out's default folder `out`.
    Its handler re-renders report.md where --report names a finished run's results.json, else runs `run(args)`."""
    parser = subparsers.add_parser(name, **options)
    (add_common_arguments if llama_server else add_run_arguments)(parser, out)
    parser.set_defaults(func=lambda args: rerender(Path(args.report), report) if args.report else run(args))
    return parser


def add_common_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """The options of a benchmark of specdec-exact serve against llama-server on the default pair, --out's default
    folder `out`."""
    parser.add_argument("--llama-server", default=None,
                        help="the llama-server binary (default: where `make llama-server` builds it)")
    parser.add_argument("--target", default=registry.DEFAULT_TARGET,
                        help="registry name or .gguf file of the target (default: %(default)s)")
    parser.add_argument("--draft", default=registry.DEFAULT_DRAFT,
                        help="the draft model, for specdec-exact serve (and llama-server -md) (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of every server (default: every core this process may use)")
    add_run_arguments(parser, out)


def add_run_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """--startup-timeout, --report and --out (default folder `out`): the options of every benchmark of servers."""
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds a server may take to become ready; specdec-exact serve calibrates its kernels on "
                             "the first start on a machine (default: %(default)s)")
    parser.add_argument("--report", default=None, metavar="RESULTS_JSON",
                        help="re-render report.md beside this results.json, measuring nothing")
    parser.add_argument("--out", default=out, help="output folder (default: %(default)s)")


def setup_of(args, concurrent: int = 1, llama_server: bool = True) -> Setup:
    """The Setup that add_common_arguments' options ask for; a missing llama-server binary (where one runs:
    llama_server) is refused with how to build it."""
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if threads < 1 or args.startup_timeout <= 0:
        raise ValueError("--threads must be >= 1, --startup-timeout > 0")
    binary = None
    if llama_server:
        binary = Path(args.llama_server) if args.llama_server else default_llama_server()
        if not binary.is_file():
            raise FileNotFoundError(f"no llama-server at {binary}: build it with `make llama-server`"
                                    + (" or pass --llama-server PATH" if not args.llama_server else ""))
    return Setup(binary, args.target, args.draft, threads, concurrent)


def names(text: str, known, flag: str) -> list[str]:
    """The comma-separated names of an option, each once; refused unless each is one of `known`."""
    found = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in found if name not in known]
    if not found or unknown:
        raise ValueError(f"{flag} takes some of {', '.join(known)}, separated by commas; got {text!r}")
    return list(dict.fromkeys(found))
