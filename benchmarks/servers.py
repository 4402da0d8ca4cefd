"""`python -m benchmarks servers`: `specdec-exact serve` against upstream llama-server, each a server process driven
over HTTP.

The baseline is what users run: llama-server built from the llama.cpp source that the installed llama-cpp-python
vendors, without specdec's kernel patch (`make llama-server`), plain, with its n-gram speculation (--spec-default)
and with the draft model (-md). Every server is a subprocess on a free loopback port; they start one after another
(each loads, and specdec calibrates, alone) and then all stay up. The prompts (data/server_prompts.json, six
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
import json
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks import harness
from benchmarks.harness import (KINDS, LLAMA_SERVER_FALLBACK, Server, Setup, add_benchmark, fmt,
                                llama_server_argv, load_prompts, measure_and_keep, median, names,
                                results_header, rotation, schedule, serving, setup_of, specdec_serve, table)
from specdec_exact.bench.runner import kernel_patch_hash, save
from specdec_exact.llama_server import CONTEXT

REFERENCE = "specdec-target-only"  # plain greedy decoding by specdec: the answers every other server is held to
ALL_KINDS = "all"
SCHEMA = "specdec-bench-servers/1"


@dataclass(frozen=True)
class Config:
    """A configuration of the registry: llama-server's (a baseline) or specdec's, and its command for a Setup."""
    baseline: bool
    argv: Callable[[Setup], tuple[str, ...]]
    env: tuple[tuple[str, str], ...] = ()
    default: bool = True  # in the default --servers list

    def server(self, name: str, setup: Setup) -> Server:
        # specdec-exact serve gives each answer's token ids (return_token_ids); llama-server only text
        return Server(name, self.argv(setup), baseline=self.baseline, token_ids=not self.baseline, env=self.env,
                      fallback=LLAMA_SERVER_FALLBACK if self.baseline else ())


# --spec-default is llama-server's own n-gram speculation preset (common/arg.cpp: ngram-mod drafts, a 24-token match,
# 48-64 tokens a draft). -md alone only loads a draft model: this llama.cpp drafts with it only when --spec-type
# names draft-simple (it infers a type from the draft's GGUF for MTP/DFlash heads only); its draft settings stay
# llama-server's defaults.
SERVERS = {
    "llama-server": Config(True, lambda s: llama_server_argv(s)),
    "llama-server-ngram": Config(True, lambda s: llama_server_argv(s, "--spec-default")),
    "llama-server-draft": Config(True, lambda s: llama_server_argv(s, "-md", s.gguf(s.draft), "--spec-type",
                                                                   "draft-simple")),
    "specdec": Config(False, lambda s: specdec_serve(s, s.draft)),
    REFERENCE: Config(False, lambda s: specdec_serve(s, "none")),
    # The overhead pair: one-token decoding on the same kernels (llama.cpp's own) with the same cache settings (f16
    # cache, flash attention), so that the decode rates differ only by what each server does per token around them.
    "llama-server-fa": Config(True, lambda s: llama_server_argv(s, "-fa", "on"), default=False),
    "specdec-target-only-own-kernels": Config(False, lambda s: specdec_serve(s, "none"),
                                              env=(("GGML_CPU_MULTI_COLUMN", "0"),), default=False),
    # llama-server over the q8_0 cache that specdec ran before it took f16 (docs/servers-zen4 compares with it)
    "llama-server-q8": Config(True, lambda s: llama_server_argv(s, "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
                              default=False),
}
DEFAULT_SERVERS = [name for name, config in SERVERS.items() if config.default]


# ---- the schedule


def run_servers(servers: list[Server], prompts: list[dict], warmup: dict, max_tokens: int, rounds: int,
                out: Path, results: dict, startup_timeout: float = 1800.0, progress: bool = True,
                concurrent: int = 1) -> dict:
    """Start every server, warm each up, then run the schedule; results["records"] gains one record per request
    and results is saved to out/results.json after every prompt. The servers are stopped however this ends.
    concurrent > 1: each round, every server in turn (order rotated per round) gets the whole prompt set from that
    many clients at once, each client sending the next prompt not yet sent when its last answer is in; the wall
    time of each such burst goes to results["bursts"]."""
    from tqdm import tqdm

    results.setdefault("records", [])
    path = out / "results.json"
    with serving(servers, out, startup_timeout, results, warmup, min(16, max_tokens)) as running:
        if concurrent > 1:
            return _run_bursts(running, prompts, max_tokens, rounds, concurrent, path, results, progress)
        turns = schedule(prompts, [s.name for s in servers], rounds)
        with tqdm(total=len(turns) * len(servers), unit="request", disable=not progress, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            for round_, prompt, order in turns:
                for name in order:
                    bar.set_description(f"{prompt['id']} {name}")
                    record = running[name].request(prompt, max_tokens)
                    results["records"].append({"server": name, "round": round_, "kind": prompt["kind"],
                                               "prompt_id": prompt["id"], **record})
                    bar.update()
                    time.sleep(harness.SETTLE_S)
                save(results, path)
    return results


def _run_bursts(running: dict, prompts: list[dict], max_tokens: int, rounds: int, concurrent: int, path: Path,
                results: dict, progress: bool) -> dict:
    """run_servers' schedule with `concurrent` clients at once (see there)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    results.setdefault("bursts", [])
    names_ = list(running)
    with tqdm(total=rounds * len(names_) * len(prompts), unit="request", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar, ThreadPoolExecutor(concurrent) as clients:
        for round_ in range(rounds):
            for name in rotation(names_, round_):
                server = running[name]
                bar.set_description(f"round {round_ + 1} {name}")

                def one(prompt: dict) -> dict:
                    record = server.request(prompt, max_tokens)
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
                time.sleep(harness.SETTLE_S)
    return results


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
                       "first_token_s_median": median([r.get("first_token_s") for r in groups[server, ALL_KINDS]])}
              for server in servers}
    return {"kinds": kinds, "servers": servers, "baselines": baselines, "tokens_per_s": rate, "best": best,
            "vs_best": ratio, "same_text": same_text, "same_tokens": same_tokens, "counts": counts}


def report(results: dict) -> str:
    s = summarise(results)
    columns = [*s["kinds"], ALL_KINDS]
    settings, machine = results["settings"], results["machine"]
    lines = ["# specdec-exact serve against llama-server", "",
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
                     fmt(c["wall_s"]), fmt(c["prompt_tokens_mean"], 0)]
                    + [fmt(s["tokens_per_s"][server][kind], 2) for kind in columns]
                    + ["(baseline)" if server in s["baselines"] else fmt(vs, 2, "x"),
                       fmt(c["decode_tokens_per_s"], 2), fmt(c["first_token_s_median"], 2)])
    lines += table(["server", "answered", "tokens", "seconds", "mean prompt tokens", *columns,
                     "vs best llama-server", "decode tokens/s (after the first token)", "median first token (s)"],
                    rows)
    ours = [server for server in s["servers"] if server not in s["baselines"]]
    if ours and s["baselines"]:
        lines += ["", "## specdec over the best llama-server configuration", "",
                  "Per kind against the llama-server configuration fastest in that kind (named in the last row).", ""]
        rows = [[server] + [fmt(s["vs_best"][server][kind], 2, "x") for kind in columns] for server in ours]
        rows.append(["best llama-server"] + [s["best"][kind] or "-" for kind in columns])
        lines += table(["server", *columns], rows)
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
                ratios = [fmt(part["vs_best"].get(server, {}).get(kind), 2, "x") for kind in s["kinds"]]
                rows.append([str(round_ + 1), server, fmt(part["tokens_per_s"][server][ALL_KINDS], 2),
                             "(baseline)" if server in part["baselines"] else fmt(vs, 2, "x"), *ratios,
                             fmt(c["decode_tokens_per_s"], 2), fmt(c["first_token_s_median"], 2)])
        lines += table(["round", "server", "tokens/s (all)", "vs best llama-server (all)",
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
        lines += table(["server", f"same text as {REFERENCE}"],
                        [[server, f"{v['same']}/{v['compared']}"] for server, v in s["same_text"].items()])
    lines += ["", "## Servers", ""]
    lines += table(["server", "command", "startup (s)"],
                    [[name, f"`{shlex.join(info['command'])}`", fmt(info.get("startup_s"))]
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


def _describe_baseline(binary: dict | None) -> str:
    """The report's words for the llama-server binary of a run (None: a run of specdec's servers alone)."""
    if binary is None:
        return "no llama-server in this run"
    return f"llama-server (unpatched): `{binary.get('path')}` ({binary.get('version')})"



# ---- the subcommand


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = add_benchmark(
        subparsers, "servers", run, report, out="bench-servers-results",
        help="benchmark specdec-exact serve against upstream llama-server, over HTTP",
        description="Start upstream llama-server (plain, --spec-default n-gram speculation, -md draft model; built "
                    "by `make llama-server`) and specdec-exact serve (default drafter, and --draft none) as "
                    "subprocesses on loopback ports and send each the same greedy chat prompts of six kinds, one "
                    "request at a time, interleaved prompt by prompt. Writes results.json and report.md under --out.")
    parser.add_argument("--servers", default=None,
                        help=f"comma-separated servers to run, of {', '.join(SERVERS)} (default: "
                             f"{','.join(DEFAULT_SERVERS)}; llama-server-fa and specdec-target-only-own-kernels are "
                             "the overhead pair: llama.cpp's own kernels and an f16 cache with flash attention in "
                             "both)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="prompt kinds (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="times the whole prompt set is sent (default: "
                                                              "%(default)s)")
    parser.add_argument("--concurrent", type=int, default=1,
                        help="clients sending requests at once to each server in turn, which then runs that many "
                             "slots (llama-server -np, specdec --max-batch); the report's \"all\" column is then "
                             "throughput (default: %(default)s, one request at a time)")
    return parser


def run(args) -> int:
    default = ",".join(name for name, config in SERVERS.items() if config.default)
    chosen = names(args.servers or default, SERVERS, "--servers")
    kinds = tuple(names(args.kinds, KINDS, "--kinds"))
    if min(args.max_tokens, args.rounds, args.concurrent) < 1:
        raise ValueError("--max-tokens, --rounds, --threads and --concurrent must be >= 1, --startup-timeout > 0")
    setup = setup_of(args, args.concurrent, llama_server=any(SERVERS[name].baseline for name in chosen))
    servers = [SERVERS[name].server(name, setup) for name in chosen]
    prompts, warmup = load_prompts(kinds)
    out = Path(args.out)
    results = {**results_header(SCHEMA, setup, packages=("llama-cpp-python", "openai")),
               "patch_md5": kernel_patch_hash(),
               "settings": {"max_tokens": args.max_tokens, "rounds": args.rounds, "threads": setup.threads,
                            "kinds": list(kinds), "prompts": len(prompts), "context": CONTEXT,
                            "concurrent": args.concurrent,
                            "target": args.target, "draft": args.draft},
               "servers": {}, "records": []}
    return measure_and_keep(lambda: run_servers(servers, prompts, warmup, args.max_tokens, args.rounds, out, results,
                                                args.startup_timeout, concurrent=args.concurrent),
                            results, out, report)
