"""`python -m benchmarks interleave`: while one client streams a long answer, another sends a long prompt (a news
article of about 2,000 tokens to summarise); how long does the streaming client wait between two pieces of its answer?

Each server takes two requests at once (specdec-exact serve --max-batch 2, llama-server -np 2). Each round, every server
in turn (the order rotated per round): the streaming request alone first (its answer and its own gaps, undisturbed),
then again with the long prompt sent once its first STARTED_AFTER pieces have come. Every round takes a new article,
so no server has its prompt cached. Reported per server, medians over rounds: the streaming client's longest gap
between two pieces while the long prompt was being read (from its sending to its first token) and over the whole
answer, the same alone, the long prompt's time to first token, and (specdec) whether the streamed answer equals the
one it gave alone, token for token.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from benchmarks.harness import (Running, Server, Setup, add_benchmark, each_turn, fmt, llama_server,
                                load_prompts, measure_and_keep, median, results_header, serving, setup_of,
                                specdec_serve, table)

SCHEMA = "specdec-bench-interleave/1"
SPECDEC, LLAMA = "specdec", "llama-server"
ARTICLE_CHARS = (8000, 9800)  # XSum articles of about 1,900-2,400 tokens
STARTED_AFTER = 8  # pieces of the streamed answer before the long prompt is sent: it is decoding by then
STREAMED = (  # the streaming client's requests, one per round in turn: long answers
    "Explain how a hash map works, from hashing to collision handling and resizing, with a small Python "
    "implementation and its complexity.",
    "Write a tutorial on Python's asyncio: the event loop, coroutines, tasks, and a worked example that fetches "
    "several URLs concurrently with error handling.",
    "Describe the life cycle of an HTTP request from typing a URL to the rendered page, step by step, naming each "
    "protocol involved.",
)


def servers(setup: Setup) -> list[Server]:
    """specdec-exact serve and llama-server, each taking two requests at once."""
    return [Server(SPECDEC, specdec_serve(setup, setup.draft), token_ids=True),
            llama_server(LLAMA, setup)]


def long_prompts(rounds: int) -> list[dict]:
    """One long prompt per round (-> source, text): the first XSum articles in file order within ARTICLE_CHARS, to
    summarise."""
    from specdec_exact.bench.workloads import load_xsum

    found = []
    for prompt in load_xsum():
        document = prompt.text.split("\n\n", 1)[1]
        if ARTICLE_CHARS[0] <= len(document) <= ARTICLE_CHARS[1]:
            found.append({"source": prompt.source,
                          "text": f"Here is a news article.\n\n{document}\n\nSummarise it in three sentences."})
            if len(found) == rounds:
                return found
    raise ValueError(f"the XSum test set holds {len(found)} articles of {ARTICLE_CHARS[0]}-{ARTICLE_CHARS[1]} "
                     f"characters, fewer than the {rounds} rounds asked for")


def gaps(arrivals: list[float], start: float | None = None, end: float | None = None) -> float | None:
    """The longest time between two consecutive arrivals [s], of those pairs whose interval overlaps start..end (all
    pairs without them); None: fewer than two arrivals."""
    spans = [(a, b) for a, b in zip(arrivals, arrivals[1:])
             if (start is None or b > start) and (end is None or a < end)]
    return max((b - a for a, b in spans), default=None)


def interleaved(server: Running, streamed: str, long_prompt: str, max_tokens: int, long_max_tokens: int) -> dict:
    """On a started server, the streamed request (from a thread of its own), and the long prompt sent from this
    thread once STARTED_AFTER of the streamed answer's pieces have come -> {"streamed": its record, "long": the long
    prompt's record, "long_sent"/"long_first" (the clock of its sending and of its first piece), "arrivals": the
    streamed answer's pieces' clock}."""
    arrivals, outcome = [], {}

    def stream():
        try:
            outcome["streamed"] = server.ask(streamed, max_tokens, arrivals=arrivals)
        except Exception as error:  # (raised again in the caller's thread)
            outcome["error"] = error

    thread = threading.Thread(target=stream, name="streaming client")
    thread.start()
    while len(arrivals) < STARTED_AFTER and thread.is_alive():
        time.sleep(0.005)
    sent = time.perf_counter()
    record = server.ask(long_prompt, long_max_tokens)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return {"streamed": outcome["streamed"], "long": record, "long_sent": sent,
            "long_first": sent + (record["first_token_s"] or record["wall_s"]), "arrivals": arrivals}


def run(servers_: list[Server], prompts: list[dict], warmup: dict, max_tokens: int, long_max_tokens: int, out: Path,
        results: dict, startup_timeout: float) -> None:
    """Start the servers, warm each up, then each round's pair of requests on every server in turn; results gains a
    record per server and round, saved after each. The servers are stopped however this ends."""
    with serving(servers_, out, startup_timeout, results, warmup) as running:
        for round_, name in each_turn(list(running), len(prompts), "round", results, out / "results.json"):
            streamed = STREAMED[round_ % len(STREAMED)]
            server, prompt = running[name], prompts[round_]
            alone_arrivals = []
            alone = server.ask(streamed, max_tokens, arrivals=alone_arrivals)
            both = interleaved(server, streamed, prompt["text"], max_tokens, long_max_tokens)
            results["records"].append(_record(name, round_, prompt["source"], alone, alone_arrivals, both))


def _record(name: str, round_: int, source: str, alone: dict, alone_arrivals: list[float], both: dict) -> dict:
    arrivals, sent, first = both["arrivals"], both["long_sent"], both["long_first"]
    return {"server": name, "round": round_, "source": source,
            "longest_gap_while_prefilling_s": gaps(arrivals, sent, first),
            "longest_gap_s": gaps(arrivals), "longest_gap_alone_s": gaps(alone_arrivals),
            "long_prompt_tokens": both["long"]["prompt_tokens"], "long_first_token_s": both["long"]["first_token_s"],
            "long_completion_tokens": both["long"]["completion_tokens"],
            "streamed_tokens": both["streamed"]["completion_tokens"],
            "streamed_identical_to_alone": (None if alone["token_ids"] is None
                                            else both["streamed"]["token_ids"] == alone["token_ids"]),
            # the streamed answer's pieces, in seconds from the long prompt's sending
            "arrivals_from_long_sent_s": [round(t - sent, 4) for t in arrivals],
            "long_first_from_sent_s": round(first - sent, 4),
            "alone": {k: alone[k] for k in ("wall_s", "first_token_s", "completion_tokens", "decode_tokens_per_s")},
            "streamed": {k: both["streamed"][k] for k in ("wall_s", "completion_tokens", "decode_tokens_per_s")},
            "long": {k: both["long"][k] for k in ("wall_s", "first_token_s", "prompt_tokens", "cached_tokens")}}


def summarise(results: dict) -> dict:
    """Per server: medians over rounds of the record's figures; the identical count; specdec's longest gap while
    prefilling over llama-server's."""
    by = {}
    for record in results["records"]:
        by.setdefault(record["server"], []).append(record)
    summary = {"servers": {}}
    for name, records in by.items():
        same = [r["streamed_identical_to_alone"] for r in records if r["streamed_identical_to_alone"] is not None]
        summary["servers"][name] = {
            "rounds": len(records),
            **{key: median([r[key] for r in records]) for key in (
                "longest_gap_while_prefilling_s", "longest_gap_s", "longest_gap_alone_s", "long_prompt_tokens",
                "long_first_token_s")},
            "worst_gap_while_prefilling_s": max((r["longest_gap_while_prefilling_s"] or 0.0) for r in records),
            "identical_to_alone": [sum(same), len(same)] if same else None}
    ours, theirs = summary["servers"].get(SPECDEC), summary["servers"].get(LLAMA)
    if ours and theirs and ours["longest_gap_while_prefilling_s"] and theirs["longest_gap_while_prefilling_s"]:
        summary["gap_vs_llama_server"] = (ours["longest_gap_while_prefilling_s"]
                                          / theirs["longest_gap_while_prefilling_s"])
        summary["long_first_token_vs_llama_server"] = ours["long_first_token_s"] / theirs["long_first_token_s"]
    return summary


def report(results: dict) -> str:
    machine, settings = results["machine"], results["settings"]
    summary = summarise(results)
    lines = ["# A streaming client while another client's long prompt is read", "",
             f"`{results['command']}`", "",
             f"Machine: {machine.get('cpu')}; {machine.get('cores')} cores, {machine.get('ram_gb')} GB.",
             f"The streamed answer: up to {settings['max_tokens']} tokens; the long prompt's: up to "
             f"{settings['long_max_tokens']}; greedy; two requests at once on every server; medians over rounds.", ""]
    rows = []
    for name, s in summary["servers"].items():
        same = s["identical_to_alone"]
        rows.append([name, str(s["rounds"]), fmt(s["longest_gap_while_prefilling_s"], 2),
                     fmt(s["worst_gap_while_prefilling_s"], 2), fmt(s["longest_gap_s"], 2),
                     fmt(s["longest_gap_alone_s"], 2),
                     f"{s['long_prompt_tokens']:.0f}", fmt(s["long_first_token_s"], 2),
                     "-" if same is None else f"{same[0]}/{same[1]}"])
    lines += table(["server", "rounds", "longest gap while the long prompt is read s", "worst round s",
                     "longest gap, whole answer s", "longest gap alone s", "long prompt tokens",
                     "long prompt: first token s", "streamed answer identical to alone"], rows)
    lines.append("")
    if "gap_vs_llama_server" in summary:
        lines.append(f"- The streaming client's longest gap while the long prompt is read, specdec / llama-server: "
                     f"**{summary['gap_vs_llama_server']:.2f}x** (below 1: shorter)")
        lines.append(f"- The long prompt's time to first token, specdec / llama-server: "
                     f"**{summary['long_first_token_vs_llama_server']:.2f}x**")
    return "\n".join(lines) + "\n"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = add_benchmark(
        subparsers, "interleave", run_command, report, out="bench-interleave-results",
        help="time a streaming client's gaps while another client's long prompt is read",
        description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens of the streamed answer at most (default: %(default)s)")
    parser.add_argument("--long-max-tokens", type=int, default=128,
                        help="tokens of the long prompt's answer at most (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per server, each with another article (default: %(default)s)")
    return parser


def run_command(args) -> int:
    if min(args.max_tokens, args.long_max_tokens, args.rounds) < 1:
        raise ValueError("--max-tokens, --long-max-tokens and --rounds must be >= 1")
    if args.max_tokens <= STARTED_AFTER:
        raise ValueError(f"--max-tokens must be above {STARTED_AFTER}: the long prompt is sent after that many "
                         "pieces of the streamed answer")
    setup = setup_of(args, concurrent=2)
    prompts = long_prompts(args.rounds)
    out = Path(args.out)
    results = {**results_header(SCHEMA, setup),
               "settings": {"max_tokens": args.max_tokens, "long_max_tokens": args.long_max_tokens,
                            "rounds": args.rounds, "threads": setup.threads, "target": args.target, "draft": args.draft,
                            "started_after_pieces": STARTED_AFTER},
               "long_prompts": [p["source"] for p in prompts], "servers": {}, "records": []}
    return measure_and_keep(lambda: run(servers(setup), prompts, load_prompts()[1], args.max_tokens,
                                        args.long_max_tokens, out, results, args.startup_timeout),
                            results, out, report)
