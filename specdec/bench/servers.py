"""`specdec bench-servers`: `specdec serve` against upstream llama-server, each a server process driven over HTTP.

The baseline is what users run: llama-server built from the llama.cpp source that the installed llama-cpp-python
vendors, without specdec's kernel patch (`make llama-server`), plain, with its n-gram speculation (--spec-default)
and with the draft model (-md). Every server is a subprocess on a free loopback port; they start one after another
(each loads, and specdec calibrates, alone) and then all stay up. The packaged prompts (data/server_prompts.json, six
kinds) go to them as greedy chat completions through the official OpenAI client, streamed, one request in
flight across all servers: every server answers a prompt in turn, the order rotated by one from prompt to prompt, so
that drift in the machine's load falls on all alike. A request's wall time includes its prefill.

Figures (summarise() derives them from the records alone):
  tokens/s               completion tokens / wall seconds, pooled over a server's requests (all, or of one kind)
  decode tokens/s        the tokens after the first / the seconds after the first token, pooled: prefill left out
  vs best llama-server   a specdec server's tokens/s over the fastest llama-server configuration's: per kind, the
                         fastest in that kind; over all kinds, the fastest pooled
  same text              answers whose text equals specdec-target-only's on the same prompt and round: greedy
                         speculative decoding must not change an answer
  same tokens            the same, token id for token id, where both servers give them (specdec's)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable
from importlib import resources
from pathlib import Path

from specdec import DISTRIBUTION, registry
from specdec.bench.runner import kernel_patch_hash, openai_module, version_of

KINDS = ("code-edit", "document-qa", "chat", "maths", "translation", "summary")
REFERENCE = "specdec-target-only"  # plain greedy decoding by specdec: the answers every other server is held to
ALL_KINDS = "all"
PORT = "{port}"  # stands for the server's port in its command line
CONTEXT = 4096  # llama-server's -c: room for the longest prompt and answer, as specdec's own context allows
NATIVE = Path(__file__).resolve().parents[2] / "native"  # the source checkout's native/: absent from a wheel
SCHEMA = "specdec-bench-servers/1"


@dataclass(frozen=True)
class Setup:
    """What every server command line is made of."""
    llama_server: Path
    target: str  # registry name or .gguf file
    draft: str
    threads: int
    concurrent: int = 1  # requests in flight at once: llama-server's slots (-np), specdec's --max-batch

    def gguf(self, name: str) -> str:
        return name if name.endswith(".gguf") else str(registry.gguf_file(name))


@dataclass(frozen=True)
class Server:
    """One server under test: its command line (PORT for its port), and how its answers are read."""
    name: str
    argv: tuple[str, ...]
    baseline: bool = False  # a llama-server configuration: specdec's servers are compared with the best of these
    token_ids: bool = False  # answers carry their token ids when the request asks (specdec's return_token_ids)
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment
    # Arguments added for a second start when the first one crashed (was killed by a signal) before it was ready:
    # what a user of that CPU must add to run the server at all.
    fallback: tuple[str, ...] = ()

    def command(self, port: int) -> list[str]:
        return [word.replace(PORT, str(port)) for word in self.argv]


# llama-server repacks the weights for the CPU by default; on an Intel Xeon with AMX (in a VM) its AMX matrix kernel
# crashes at the first pass (a general protection fault in ggml_backend_amx_mul_mat, seen at startup), so there a
# user runs it with the plain layout.
LLAMA_SERVER_FALLBACK = ("--no-repack",)


def _llama_server(setup: Setup, *extra: str) -> tuple[str, ...]:
    # -c is shared among the -np slots: CONTEXT tokens each
    return (str(setup.llama_server), "-m", setup.gguf(setup.target), "-t", str(setup.threads), "-c",
            str(CONTEXT * setup.concurrent), "-np", str(setup.concurrent), "--host", "127.0.0.1", "--port", PORT,
            *extra)


def llama_server(name: str, setup: Setup, *extra: str) -> Server:
    """llama-server as a baseline under test: the target, these extra arguments, and the fallback for CPUs where its
    defaults crash."""
    return Server(name, _llama_server(setup, *extra), baseline=True, fallback=LLAMA_SERVER_FALLBACK)


def _specdec_serve(setup: Setup, draft: str) -> tuple[str, ...]:
    batch = ("--max-batch", str(setup.concurrent)) if setup.concurrent > 1 else ()  # else its default
    return (sys.executable, "-m", "specdec.cli", "serve", "--target", setup.target, "--draft", draft, "--threads",
            str(setup.threads), *batch, "--host", "127.0.0.1", "--port", PORT)


@dataclass(frozen=True)
class Config:
    """A configuration of the registry: llama-server's (a baseline) or specdec's, and its command for a Setup."""
    baseline: bool
    argv: Callable[[Setup], tuple[str, ...]]
    env: tuple[tuple[str, str], ...] = ()
    default: bool = True  # in the default --servers list

    def server(self, name: str, setup: Setup) -> Server:
        # specdec serve gives each answer's token ids (return_token_ids); llama-server only text
        return Server(name, self.argv(setup), baseline=self.baseline, token_ids=not self.baseline, env=self.env,
                      fallback=LLAMA_SERVER_FALLBACK if self.baseline else ())


# --spec-default is llama-server's own n-gram speculation preset (common/arg.cpp: ngram-mod drafts, a 24-token match,
# 48-64 tokens a draft). -md alone only loads a draft model: this llama.cpp drafts with it only when --spec-type
# names draft-simple (it infers a type from the draft's GGUF for MTP/DFlash heads only); its draft settings stay
# llama-server's defaults.
SERVERS = {
    "llama-server": Config(True, lambda s: _llama_server(s)),
    "llama-server-ngram": Config(True, lambda s: _llama_server(s, "--spec-default")),
    "llama-server-draft": Config(True, lambda s: _llama_server(s, "-md", s.gguf(s.draft), "--spec-type",
                                                               "draft-simple")),
    "specdec": Config(False, lambda s: _specdec_serve(s, s.draft)),
    REFERENCE: Config(False, lambda s: _specdec_serve(s, "none")),
    # The overhead pair: one-token decoding on the same kernels (llama.cpp's own) with the same cache settings (f16
    # cache, flash attention), so that the decode rates differ only by what each server does per token around them.
    "llama-server-fa": Config(True, lambda s: _llama_server(s, "-fa", "on"), default=False),
    "specdec-target-only-own-kernels": Config(False, lambda s: _specdec_serve(s, "none"),
                                              env=(("GGML_CPU_MULTI_COLUMN", "0"),), default=False),
    # llama-server over the q8_0 cache that specdec ran before it took f16 (docs/servers-zen4 compares with it)
    "llama-server-q8": Config(True, lambda s: _llama_server(s, "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
                              default=False),
}
DEFAULT_SERVERS = [name for name, config in SERVERS.items() if config.default]


class ServerError(RuntimeError):
    """A server under test exited, or did not become ready in time."""


class ServerProcess:
    """A server under test as a subprocess on a free loopback port: started, awaited until /health answers 200, and
    stopped on exit (terminate, then kill), whatever happened in between. Its output goes to `log`. A server that
    crashes (is killed by a signal) before it is ready is started once more with its fallback arguments, where it
    has some; `fallback` then says why (else None)."""

    def __init__(self, server: Server, log: Path, startup_timeout: float = 1800.0, stop_timeout: float = 15.0):
        self.server, self.log_path, self.startup_timeout = server, Path(log), startup_timeout
        self.stop_timeout = stop_timeout  # seconds from terminate to kill
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.fallback: str | None = None

    def __enter__(self) -> ServerProcess:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = self.server.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # a file, not a pipe: a pipe nobody reads fills up and blocks the server
        started = time.perf_counter()
        try:
            try:
                self._start()
            except ServerError:
                code = self.process.poll() if self.process is not None else None
                if not (self.server.fallback and code is not None and code < 0):
                    raise
                self.fallback = (f"{shlex.join(self.argv)} crashed at startup (signal {-code}) on this CPU: "
                                 f"started again with {shlex.join(self.server.fallback)}")
                print(f"{self.server.name}: {self.fallback}", file=sys.stderr, flush=True)
                self.argv = [*self.argv, *self.server.fallback]
                self._start()
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.perf_counter() - started
        return self

    def _start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, env={**os.environ, **dict(self.server.env)})
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while True:
            self.check_alive()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:  # llama-server: 503 while loading
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"{self.server.name} was not ready after {self.startup_timeout:.0f} s: "
                                  f"{shlex.join(self.argv)}\n{self.tail()}")
            time.sleep(0.25)

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise ServerError(f"{self.server.name} exited with status {code}: {shlex.join(self.argv)}\n"
                              f"its last output ({self.log_path}):\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(no output)"

    def get_json(self, path: str) -> dict | None:
        """GET path -> its JSON body where it answers 200, else None."""
        import httpx

        try:
            response = httpx.get(f"{self.url}{path}", timeout=10)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- the prompts and the schedule


def load_prompts(kinds: tuple[str, ...] = KINDS) -> tuple[list[dict], dict]:
    """The packaged prompts of the given kinds, in file order, and the warm-up prompt (never measured)."""
    data = json.loads(resources.files("specdec.bench").joinpath("data/server_prompts.json").read_text())
    return [p for p in data["prompts"] if p["kind"] in kinds], data["warmup"]


def schedule(prompts: list[dict], servers: list[str], rounds: int) -> list[tuple[int, dict, list[str]]]:
    """(round, prompt, server order) for every prompt of every round: every server answers the prompt in turn, the
    order rotated by one from one prompt to the next, so that no server always goes first (after a cold cache) or
    last."""
    turns = []
    for round_ in range(rounds):
        for i, prompt in enumerate(prompts):
            shift = (round_ * len(prompts) + i) % len(servers)
            turns.append((round_, prompt, servers[shift:] + servers[:shift]))
    return turns


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


def start_servers(stack, servers: list[Server], out: Path, startup_timeout: float,
                  results: dict) -> dict[str, tuple[Server, ServerProcess, object, str]]:
    """Start each server in turn, its log in out/logs, each stopped when `stack` (a contextlib.ExitStack) closes ->
    name -> (server, its process, an OpenAI client of it, its model's id); results["servers"] gains each one's command
    line, model, start-up time, fallback and kernel plan."""
    openai = openai_module()
    running = {}
    for server in servers:
        print(f"starting {server.name} ...", file=sys.stderr, flush=True)
        proc = stack.enter_context(ServerProcess(server, out / "logs" / f"{server.name}.log", startup_timeout))
        model = ((proc.get_json("/v1/models") or {}).get("data") or [{}])[0].get("id", "default")
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=1800)
        running[server.name] = (server, proc, client, model)
        results.setdefault("servers", {})[server.name] = {
            "command": proc.argv, "baseline": server.baseline, "model": model, "startup_s": proc.startup_s,
            "fallback": proc.fallback,
            # a hook: the kernel plan of specdec's runtime, where the server publishes it
            "kernel_plan": None if server.baseline else proc.get_json("/v1/specdec/plan")}
        print(f"{server.name} ready in {proc.startup_s:.1f} s", file=sys.stderr, flush=True)
    return running


def run_servers(servers: list[Server], prompts: list[dict], warmup: dict, max_tokens: int, rounds: int,
                out: Path, results: dict, startup_timeout: float = 1800.0, progress: bool = True,
                concurrent: int = 1) -> dict:
    """Start every server, warm each up, then run the schedule; results["records"] gains one record per request
    and results is saved to out/results.json after every prompt. The servers are stopped however this ends.
    concurrent > 1: each round, every server in turn (order rotated per round) gets the whole prompt set from that
    many clients at once, each client sending the next prompt not yet sent when its last answer is in; the wall
    time of each such burst goes to results["bursts"]."""
    import contextlib

    from tqdm import tqdm

    from specdec.bench.runner import save

    results.setdefault("records", [])
    path = out / "results.json"
    with contextlib.ExitStack() as stack:
        running = start_servers(stack, servers, out, startup_timeout, results)
        for server, proc, client, model in running.values():  # first passes over cold weights: not measured
            _request(proc, client, model, warmup, min(16, max_tokens), server.token_ids)
        if concurrent > 1:
            return _run_bursts(running, prompts, max_tokens, rounds, concurrent, path, results, progress)
        turns = schedule(prompts, [s.name for s in servers], rounds)
        with tqdm(total=len(turns) * len(servers), unit="request", disable=not progress, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            for round_, prompt, order in turns:
                for name in order:
                    bar.set_description(f"{prompt['id']} {name}")
                    server, proc, client, model = running[name]
                    record = _request(proc, client, model, prompt, max_tokens, server.token_ids)
                    results["records"].append({"server": name, "round": round_, "kind": prompt["kind"],
                                               "prompt_id": prompt["id"], **record})
                    bar.update()
                save(results, path)
    return results


def _run_bursts(running: dict, prompts: list[dict], max_tokens: int, rounds: int, concurrent: int, path: Path,
                results: dict, progress: bool) -> dict:
    """run_servers' schedule with `concurrent` clients at once (see there)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from specdec.bench.runner import save

    results.setdefault("bursts", [])
    names = list(running)
    with tqdm(total=rounds * len(names) * len(prompts), unit="request", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar, ThreadPoolExecutor(concurrent) as clients:
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                server, proc, client, model = running[name]
                bar.set_description(f"round {round_ + 1} {name}")

                def one(prompt: dict) -> dict:
                    record = _request(proc, client, model, prompt, max_tokens, server.token_ids)
                    bar.update()
                    return {"server": name, "round": round_, "kind": prompt["kind"], "prompt_id": prompt["id"],
                            **record}

                started = time.perf_counter()
                records = list(clients.map(one, prompts))  # (map hands the prompts out in order, one per free client)
                wall_s = time.perf_counter() - started
                results["records"] += records
                results["bursts"].append({"server": name, "round": round_, "wall_s": wall_s,
                                          "completion_tokens": sum(r.get("completion_tokens") or 0 for r in records)})
                save(results, path)
    return results


def _request(proc: ServerProcess, client, model: str, prompt: dict, max_tokens: int, token_ids: bool) -> dict:
    """ask(), a failed request recorded rather than raised; a server that died on it stops the run."""
    openai = openai_module()
    try:
        return ask(client, model, prompt["prompt"], max_tokens, token_ids)
    except openai.OpenAIError as error:
        proc.check_alive()
        return {"error": f"{type(error).__name__}: {error}"}


@contextlib.contextmanager
def llama_server_session(binary: Path, gguf: str, threads: int, prompt: str, max_tokens: int, chat: bool, log: Path):
    """Upstream llama-server (plain, its defaults) up on the target's file, warmed up on the prompt: the baseline of
    `specdec generate --compare`. Yields (measure, its settings in words: "its defaults", or the fallback its crash on
    this CPU called for), where measure() -> tokens/s of one greedy request of the prompt, prefill included: the
    whole prompt, as for a new one (`cache_prompt: false`: its slot does not reuse the warm-up's). chat: a chat
    completion of the prompt as the user's message (llama-server applies the GGUF's chat template, as specdec
    applies the tokenizer's); else a completion of the prompt as it is."""
    openai = openai_module()
    setup = Setup(binary, gguf, gguf, threads)
    server = llama_server("llama-server", setup)
    with ServerProcess(server, log) as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=1800)
        model = ((proc.get_json("/v1/models") or {}).get("data") or [{}])[0].get("id", "default")
        settings = "its defaults" if proc.fallback is None else (
            f"its defaults and {shlex.join(server.fallback)}: its defaults crash on this CPU")

        def measure(tokens: int = max_tokens) -> float:
            cold = {"cache_prompt": False}
            if chat:
                return ask(client, model, prompt, tokens, token_ids=False, extra_body=cold)["tokens_per_s"]
            started = time.perf_counter()
            response = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                                 extra_body=cold)
            return response.usage.completion_tokens / (time.perf_counter() - started)

        measure(min(2, max_tokens))  # untimed warm-up
        yield measure, settings


def llama_server_rate(binary: Path, gguf: str, threads: int, prompt: str, max_tokens: int, chat: bool,
                      log: Path) -> tuple[float, str]:
    """Tokens/s of upstream llama-server on one greedy request of the prompt after a warm-up (llama_server_session)
    -> (tokens/s, its settings in words)."""
    with llama_server_session(binary, gguf, threads, prompt, max_tokens, chat, log) as (measure, settings):
        return measure(), settings


# ---- the figures


def _rate(records: list[dict]) -> float | None:
    seconds = sum(r["wall_s"] for r in records)
    return sum(r["completion_tokens"] for r in records) / seconds if seconds > 0 else None


def _decode_rate(records: list[dict]) -> float | None:
    """Tokens after the first over the seconds after the first token, pooled: the decode rate, prefill excluded."""
    timed = [r for r in records if r.get("first_token_s") is not None and r["completion_tokens"] > 1]
    seconds = sum(r["wall_s"] - r["first_token_s"] for r in timed)
    return sum(r["completion_tokens"] - 1 for r in timed) / seconds if seconds > 0 else None


def summarise(results: dict) -> dict:
    """From the records alone: per server, pooled tokens/s over all kinds and per kind; the best llama-server
    configuration per kind; each specdec server's ratio to it; answers with the same text as REFERENCE's."""
    records = results["records"]
    done = [r for r in records if "error" not in r]
    baselines = [name for name, info in results["servers"].items() if info["baseline"]]
    servers = list(dict.fromkeys([*results["servers"], *(r["server"] for r in records)]))
    kinds = [kind for kind in KINDS if any(r["kind"] == kind for r in done)]
    groups = defaultdict(list)
    for r in done:
        groups[r["server"], r["kind"]].append(r)
        groups[r["server"], ALL_KINDS].append(r)
    columns = [*kinds, ALL_KINDS]
    rate = {server: {kind: _rate(groups[server, kind]) for kind in columns} for server in servers}
    bursts = results.get("bursts") or []
    for server in servers if bursts else ():  # concurrent clients: over all kinds, all tokens over all bursts' time
        mine = [b for b in bursts if b["server"] == server]
        seconds = sum(b["wall_s"] for b in mine)
        rate[server][ALL_KINDS] = sum(b["completion_tokens"] for b in mine) / seconds if seconds > 0 else None
    best = {}
    for kind in columns:
        measured = [(rate[name][kind], name) for name in baselines if rate[name][kind] is not None]
        best[kind] = max(measured)[1] if measured else None
    ratio = {server: {kind: (rate[server][kind] / rate[best[kind]][kind]
                             if best[kind] and rate[server][kind] is not None else None) for kind in columns}
             for server in servers if server not in baselines}
    reference = {(r["round"], r["prompt_id"]): r["text"] for r in done if r["server"] == REFERENCE}
    same_text = {}
    for server in servers:
        if server == REFERENCE or not reference:
            continue
        pairs = [(r["text"], reference[r["round"], r["prompt_id"]]) for r in done
                 if r["server"] == server and (r["round"], r["prompt_id"]) in reference]
        same_text[server] = {"same": sum(a == b for a, b in pairs), "compared": len(pairs)}
    # Where both servers give token ids (specdec's), the answers compared token for token: equal text can hide
    # different tokens.
    reference_ids = {(r["round"], r["prompt_id"]): r["token_ids"] for r in done
                     if r["server"] == REFERENCE and r.get("token_ids") is not None}
    same_tokens = {}
    for server in servers:
        pairs = [(r["token_ids"], reference_ids[r["round"], r["prompt_id"]]) for r in done
                 if r["server"] == server and server != REFERENCE and r.get("token_ids") is not None
                 and (r["round"], r["prompt_id"]) in reference_ids]
        if pairs:
            same_tokens[server] = {"same": sum(a == b for a, b in pairs), "compared": len(pairs)}
    counts = {server: {"requests": sum(r["server"] == server for r in records),
                       "failed": sum(r["server"] == server and "error" in r for r in records),
                       "completion_tokens": sum(r["completion_tokens"] for r in groups[server, ALL_KINDS]),
                       "wall_s": (sum(b["wall_s"] for b in bursts if b["server"] == server) if bursts
                                  else sum(r["wall_s"] for r in groups[server, ALL_KINDS])),
                       "prompt_tokens_mean": (sum(r["prompt_tokens"] for r in groups[server, ALL_KINDS])
                                              / len(groups[server, ALL_KINDS]) if groups[server, ALL_KINDS] else None),
                       "decode_tokens_per_s": _decode_rate(groups[server, ALL_KINDS]),
                       "first_token_s_median": _median([r.get("first_token_s") for r in groups[server, ALL_KINDS]])}
              for server in servers}
    return {"kinds": kinds, "servers": servers, "baselines": baselines, "tokens_per_s": rate, "best": best,
            "vs_best": ratio, "same_text": same_text, "same_tokens": same_tokens, "counts": counts}


def _median(values: list) -> float | None:
    import statistics

    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _f(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def report(results: dict) -> str:
    s = summarise(results)
    columns = [*s["kinds"], ALL_KINDS]
    settings, machine = results["settings"], results["machine"]
    lines = ["# specdec serve against llama-server", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {machine['cpu']}, {machine['cores']} cores, load average at start "
             f"{', '.join(f'{x:.2f}' for x in machine.get('load_average_at_start', []))}  ",
             f"llama-cpp-python {results['versions'].get('llama-cpp-python')}, specdec's kernel patch "
             f"{results.get('patch_md5')}; {_describe_baseline(results.get('llama_server'))}  ",
             f"Greedy chat completions of at most {settings['max_tokens']} tokens, {settings['threads']} threads per "
             f"server, {settings['rounds']} round(s) of {settings['prompts']} prompts ({', '.join(s['kinds'])}); "
             + (f"**{settings['concurrent']} clients at once**: each round every server in turn (order rotated per "
                "round) answers the whole prompt set, each client sending the next prompt when its answer is in "
                "(llama-server with as many slots, -np; specdec with --max-batch). Column \"all\": throughput, all "
                "completion tokens over the servers' burst wall time; the kinds' columns: per request, tokens over "
                "each request's own wall time (prefill and waiting included)."
                if settings.get("concurrent", 1) > 1 else
                "one request at a time across all servers, each prompt answered by every server in turn (order "
                "rotated per prompt). Wall time per request, prefill included; tokens/s pooled (all completion "
                "tokens / all seconds)."), "", "## Tokens/s", ""]
    rows = []
    for server in s["servers"]:
        c = s["counts"][server]
        vs = s["vs_best"].get(server, {}).get(ALL_KINDS)
        rows.append([server, f"{c['requests'] - c['failed']}/{c['requests']}", str(c["completion_tokens"]),
                     _f(c["wall_s"]), _f(c["prompt_tokens_mean"], 0)]
                    + [_f(s["tokens_per_s"][server][kind], 2) for kind in columns]
                    + ["(baseline)" if server in s["baselines"] else _f(vs, 2, "x"),
                       _f(c["decode_tokens_per_s"], 2), _f(c["first_token_s_median"], 2)])
    lines += _table(["server", "answered", "tokens", "seconds", "mean prompt tokens", *columns,
                     "vs best llama-server", "decode tokens/s (after the first token)", "median first token (s)"],
                    rows)
    ours = [server for server in s["servers"] if server not in s["baselines"]]
    if ours and s["baselines"]:
        lines += ["", "## specdec over the best llama-server configuration", "",
                  "Per kind against the llama-server configuration fastest in that kind (named in the last row).", ""]
        rows = [[server] + [_f(s["vs_best"][server][kind], 2, "x") for kind in columns] for server in ours]
        rows.append(["best llama-server"] + [s["best"][kind] or "-" for kind in columns])
        lines += _table(["server", *columns], rows)
    if settings["rounds"] > 1:
        lines += ["", "## By round", "",
                  "In round 1 every server sees each prompt for the first time. From round 2 on, llama-server answers "
                  "prompts it has seen: its prompt cache in RAM restores their KV cache (the time to the first token "
                  "shows it), and its n-gram speculation drafts from its own earlier answers. specdec's prompt "
                  "cache restores the segments of the prompt that a prefill computed (messages and 128-token "
                  "blocks: all but the answer's start), exactly, and its suffix lookup drafts from earlier answers "
                  "too.", ""]
        rows = []
        for round_ in range(settings["rounds"]):
            part = summarise({**results, "records": [r for r in results["records"] if r["round"] == round_],
                              "bursts": [b for b in results.get("bursts", []) if b["round"] == round_]})
            for server in part["servers"]:
                c = part["counts"][server]
                vs = part["vs_best"].get(server, {}).get(ALL_KINDS)
                ratios = [_f(part["vs_best"].get(server, {}).get(kind), 2, "x") for kind in s["kinds"]]
                rows.append([str(round_ + 1), server, _f(part["tokens_per_s"][server][ALL_KINDS], 2),
                             "(baseline)" if server in part["baselines"] else _f(vs, 2, "x"), *ratios,
                             _f(c["decode_tokens_per_s"], 2), _f(c["first_token_s_median"], 2)])
        lines += _table(["round", "server", "tokens/s (all)", "vs best llama-server (all)",
                         *(f"vs best, {kind}" for kind in s["kinds"]), "decode tokens/s", "median first token (s)"],
                        rows)
    if s["same_text"]:
        lines += ["", "## Same answers", ""]
        if "specdec" in s.get("same_tokens", {}):
            same = s["same_tokens"]["specdec"]
            lines += [f"**specdec and {REFERENCE}: {same['same']}/{same['compared']} answers with identical token "
                      "ids.**", ""]
        elif "specdec" in s["same_text"]:
            same = s["same_text"]["specdec"]
            lines += [f"**specdec and {REFERENCE}: {same['same']}/{same['compared']} answers with identical text.**",
                      ""]
        lines += _table(["server", f"same text as {REFERENCE}"],
                        [[server, f"{v['same']}/{v['compared']}"] for server, v in s["same_text"].items()])
    lines += ["", "## Servers", ""]
    lines += _table(["server", "command", "startup (s)"],
                    [[name, f"`{shlex.join(info['command'])}`", _f(info.get("startup_s"))]
                     for name, info in results["servers"].items()])
    fallbacks = {name: info["fallback"] for name, info in results["servers"].items() if info.get("fallback")}
    if fallbacks:
        lines += ["", "Started again after a crash (what a user of this CPU must run):", ""]
        lines += [f"- {name}: {why}" for name, why in fallbacks.items()]
    plans = {name: info["kernel_plan"] for name, info in results["servers"].items() if info.get("kernel_plan")}
    for name, plan in plans.items():
        lines += ["", f"Kernel plan of {name}: `{json.dumps(plan)}`"]
    errors = sorted({r["error"] for r in results["records"] if "error" in r})
    if errors:
        lines += ["", "Errors: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


# ---- the subcommand


def add_common_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """The options of a benchmark of specdec serve against llama-server on the default pair (bench-conversation,
    bench-interleave), --out's default folder `out`."""
    parser.add_argument("--llama-server", default=None,
                        help="the llama-server binary (default: where `make llama-server` builds it)")
    parser.add_argument("--target", default=registry.DEFAULT_TARGET, help="(default: %(default)s)")
    parser.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="specdec's draft (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of every server (default: every core this process may use)")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds a server may take to become ready (default: %(default)s)")
    parser.add_argument("--report", default=None,
                        help="re-render report.md beside this results.json, measuring nothing")
    parser.add_argument("--out", default=out, help="output folder (default: %(default)s)")


def setup_of(args, concurrent: int = 1) -> Setup:
    """The Setup that add_common_arguments' options ask for; a missing llama-server binary is refused with how to
    build it."""
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if threads < 1 or args.startup_timeout <= 0:
        raise ValueError("--threads must be >= 1, --startup-timeout > 0")
    binary = Path(args.llama_server) if args.llama_server else default_llama_server()
    if not binary.is_file():
        raise FileNotFoundError(f"no llama-server at {binary}: build it with `make llama-server`"
                                + (" or pass --llama-server PATH" if not args.llama_server else ""))
    return Setup(binary, args.target, args.draft, threads, concurrent)


def results_header(schema: str, setup: Setup) -> dict:
    """What every benchmark's results.json opens with: the schema, the start, the command, the machine, the versions
    and the llama-server binary."""
    from specdec.bench.runner import machine_info

    return {"schema": schema, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": shlex.join(["specdec", *sys.argv[1:]]), "machine": machine_info(),
            "versions": {"specdec": version_of(DISTRIBUTION), "llama-cpp-python": _llama_cpp_version()},
            "llama_server": _describe_binary(setup.llama_server)}


def default_llama_server() -> Path:
    """Where `make llama-server` builds the binary, keyed as the Makefile keys it: the CPU's flags line, the
    llama-cpp-python version and the build script."""
    script = NATIVE / "build-llama-server.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} is missing (not a source checkout): pass --llama-server PATH")
    flags = ""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        pass
    cpu_key = hashlib.md5(flags.encode()).hexdigest()[:12]
    script_key = hashlib.md5(script.read_bytes()).hexdigest()[:8]
    return registry.cache_root() / "llama-server" / f"{cpu_key}-{_llama_cpp_version()}-{script_key}" / "llama-server"


def _llama_cpp_version() -> str | None:
    return version_of("llama-cpp-python")


def _names(text: str, known, flag: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise ValueError(f"{flag} takes some of {', '.join(known)}, separated by commas; got {text!r}")
    return list(dict.fromkeys(names))


def add_bench_servers_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench-servers", help="benchmark specdec serve against upstream llama-server, over HTTP",
        description="Start upstream llama-server (plain, --spec-default n-gram speculation, -md draft model; built "
                    "by `make llama-server`) and specdec serve (default drafter, and --draft none) as subprocesses "
                    "on loopback ports and send each the same greedy chat prompts of six kinds, one request at a "
                    "time, interleaved prompt by prompt. Writes results.json and report.md under --out.")
    parser.add_argument("--servers", default=None,
                        help=f"comma-separated servers to run, of {', '.join(SERVERS)} (default: "
                             f"{','.join(DEFAULT_SERVERS)}; llama-server-fa and specdec-target-only-own-kernels are the "
                             "overhead pair: llama.cpp's own kernels and an f16 cache with flash attention in both)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="prompt kinds (default: %(default)s)")
    parser.add_argument("--report", default=None,
                        help="re-render report.md beside this results.json, measuring nothing")
    parser.add_argument("--llama-server", default=None,
                        help="the llama-server binary (default: where `make llama-server` builds it)")
    parser.add_argument("--target", default=registry.DEFAULT_TARGET,
                        help="registry name or .gguf file of the target (default: %(default)s)")
    parser.add_argument("--draft", default=registry.DEFAULT_DRAFT,
                        help="the draft model, for llama-server -md and specdec serve (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="times the whole prompt set is sent (default: "
                                                              "%(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of every server (default: every core this process may use)")
    parser.add_argument("--concurrent", type=int, default=1,
                        help="clients sending requests at once to each server in turn, which then runs that many "
                             "slots (llama-server -np, specdec --max-batch); the report's \"all\" column is then "
                             "throughput (default: %(default)s, one request at a time)")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds a server may take to become ready; specdec serve calibrates its kernels on "
                             "the first start on a machine (default: %(default)s)")
    parser.add_argument("--out", default="bench-servers-results", help="output folder (default: %(default)s)")
    parser.set_defaults(func=run_bench_servers)
    return parser


def run_bench_servers(args) -> int:
    from specdec.bench.runner import machine_info

    if args.report:  # re-render the report of a finished run
        return rerender(Path(args.report), report)

    names = _names(args.servers or ",".join(name for name, config in SERVERS.items() if config.default), SERVERS,
                   "--servers")
    kinds = tuple(_names(args.kinds, KINDS, "--kinds"))
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if min(args.max_tokens, args.rounds, threads, args.concurrent) < 1 or args.startup_timeout <= 0:
        raise ValueError("--max-tokens, --rounds, --threads and --concurrent must be >= 1, --startup-timeout > 0")
    binary = None
    if any(SERVERS[name].baseline for name in names):
        binary = Path(args.llama_server) if args.llama_server else default_llama_server()
        if not binary.is_file():
            raise FileNotFoundError(f"no llama-server at {binary}: build it with `make llama-server`"
                                    + (" or pass --llama-server PATH" if not args.llama_server else ""))
    setup = Setup(binary, args.target, args.draft, threads, args.concurrent)
    servers = [SERVERS[name].server(name, setup) for name in names]
    prompts, warmup = load_prompts(kinds)
    out = Path(args.out)
    results = {"schema": SCHEMA, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "command": shlex.join(["specdec", *sys.argv[1:]]), "machine": machine_info(),
               "versions": {"specdec": version_of(DISTRIBUTION), "llama-cpp-python": _llama_cpp_version(),
                            "openai": version_of("openai")},
               "patch_md5": kernel_patch_hash(), "llama_server": _describe_binary(binary),
               "settings": {"max_tokens": args.max_tokens, "rounds": args.rounds, "threads": threads,
                            "kinds": list(kinds), "prompts": len(prompts), "context": CONTEXT,
                            "concurrent": args.concurrent,
                            "target": args.target, "draft": args.draft},
               "servers": {}, "records": []}
    return measure_and_keep(lambda: run_servers(servers, prompts, warmup, args.max_tokens, args.rounds, out, results,
                                                args.startup_timeout, concurrent=args.concurrent),
                            results, out, report)


def measure_and_keep(measure: Callable[[], object], results: dict, out: Path, report: Callable[[dict], str]) -> int:
    """Run a benchmark of servers -> the exit code. A `kill` stops it (and so its servers) as Ctrl-C does, and what
    it measured before an error or an interrupt is saved in out/results.json with its report.md."""
    from specdec.bench.runner import save

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        measure()
    except ServerError as error:
        print(f"specdec: error: {error}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
        results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
        if results["records"]:
            save(results, out / "results.json")
            _write(out / "report.md", report(results))
    print((out / "report.md").read_text())
    print(f"wrote {out}/results.json and {out}/report.md (server logs in {out}/logs)")
    return 0


def rerender(results_json: Path, report: Callable[[dict], str]) -> int:
    """Write report.md again beside a finished run's results.json, measuring nothing, and show it."""
    _write(results_json.with_name("report.md"), report(json.loads(results_json.read_text())))
    print(results_json.with_name("report.md").read_text())
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _describe_baseline(binary: dict | None) -> str:
    """The report's words for the llama-server binary of a run (None: a run of specdec's servers alone)."""
    if binary is None:
        return "no llama-server in this run"
    return f"llama-server (unpatched): `{binary.get('path')}` ({binary.get('version')})"


def _describe_binary(binary: Path | None) -> dict | None:
    if binary is None:
        return None
    try:
        shown = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        version = " ".join((shown.stdout + shown.stderr).split()) or None
    except (OSError, subprocess.TimeoutExpired):
        version = None
    return {"path": str(binary), "version": version}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    os.replace(partial, path)
