"""`specdec` command line: subcommands are registered by name, each with its own parser and handler."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from specdec_exact import bench, server
from specdec_exact.options import add_generation_args, generator_from_args, run_subcommands
from specdec_exact.registry.command import add_models_parser
from specdec_exact.runtimes import LLAMA_CPP

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome."
COMPARE_ROUNDS = 3  # --compare runs each configuration this many times, in turn, and reports the medians


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text with speculative decoding")
    add_generation_args(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a short coding task)")
    source.add_argument("--prompt-file", type=argparse.FileType("r", encoding="utf-8"), metavar="FILE",
                        help="read the prompt from FILE (- for standard input)")
    parser.add_argument("--chat", action="store_true", help="apply the target's chat template to the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    parser.add_argument("--compare", action="store_true",
                        help="also run target-only decoding (and upstream llama-server, where `make llama-server` "
                             "built it) on the same prompt and report the measured speed-ups")
    parser.add_argument("--compare-rounds", type=positive_int, default=COMPARE_ROUNDS,
                        help=f"--compare runs each configuration this many times, in turn, and reports the medians "
                             f"(default {COMPARE_ROUNDS})")
    parser.set_defaults(func=run_generate)


def run_generate(args) -> int:
    if args.prompt_file is not None:
        with args.prompt_file as file:
            args.prompt = file.read()
    gen = generator_from_args(args)
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat)
    if args.json:
        out = gen.generate(args.prompt, **settings)
    else:  # the answer as it comes, before any comparison
        from specdec_exact.display import MarkedStream

        shown = MarkedStream(gen.tokenizer)
        for chunk in gen.stream(args.prompt, **settings):
            shown.add(chunk)
        shown.end()
        out = shown.result()
    comparison = _compare(gen, args, settings, out) if args.compare else None
    if args.json:
        record = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "stats": out.stats.to_dict(), "cross_vocabulary": gen.cross_vocabulary,
                  "kernel_plans": gen.kernel_plans()}
        if comparison is not None:  # medians of the rounds, and each speed-up as the ratio of the medians
            ours = comparison["specdec"]
            record["compared"] = {"rounds": comparison["rounds"], "tokens_per_s": ours}
            record["baseline"] = {"tokens_per_s": comparison["target_only"], "identical": comparison["identical"],
                                  "speedup": ours / comparison["target_only"]}
            if "llama_server" in comparison:
                record["llama_server"] = {"tokens_per_s": comparison["llama_server"],
                                          "speedup": ours / comparison["llama_server"],
                                          "settings": comparison["llama_server_settings"]}
            if "llama_cpp" in comparison:
                record["llama_cpp"] = {"tokens_per_s": comparison["llama_cpp"],
                                       "speedup": ours / comparison["llama_cpp"]}
        print(json.dumps(record))
        return 0
    from specdec_exact.display import summary_line

    print(summary_line(out.stats, args.draft != "none"))
    if comparison is not None:
        ours = comparison["specdec"]
        rounds = comparison["rounds"]
        runs = "each run once, in turn" if rounds == 1 else f"each run {rounds} times in turn (medians)"
        print(f"compared, {runs}: specdec {ours:.2f} tokens/s")
        same = "identical output" if comparison["identical"] else "different samples"
        print(f"target-only: {comparison['target_only']:.2f} tokens/s -> speed-up "
              f"{ours / comparison['target_only']:.2f}x ({same})")
        if "llama_server" in comparison:
            rate = comparison["llama_server"]
            print(f"upstream llama-server (unpatched, {comparison['llama_server_settings']}, same file, over HTTP): "
                  f"{rate:.2f} tokens/s -> speed-up {ours / rate:.2f}x")
        if "llama_cpp" in comparison:
            rate = comparison["llama_cpp"]
            print(f"plain llama.cpp (llama-cpp-python's own loop, its default settings, same file): {rate:.2f} "
                  f"tokens/s -> speed-up {ours / rate:.2f}x (build upstream llama-server with `make llama-server` "
                  "to compare with it instead)")
        for role, plan in gen.kernel_plans().items():
            print(f"kernel plan ({role}, passes of 1-16 tokens): {plan}")
    return 0


def _compare(gen, args, settings: dict, out) -> dict:
    """specdec, target-only and upstream llama-server (else llama-cpp-python's own loop, where llama-server is not
    built or cannot run the request) on the same prompt, --compare-rounds times each in turn so that a machine whose
    speed drifts weighs on all alike -> {rounds, specdec, target_only, identical, llama_server and
    llama_server_settings or llama_cpp}: tokens/s medians, prefill included. Each round of specdec and of target-only
    runs as a tenant of its own (generate's tenant): its suffix lookup cannot draft an earlier round's answer, and its
    prompt is prefilled whole, as a new prompt is (the command keeps no prompt cache; llama-server is asked not to
    reuse its slot's)."""
    from statistics import median

    from specdec_exact.generator import SpeculativeGenerator

    plain = SpeculativeGenerator(gen.target, None, tokenizer=gen.tokenizer, runtime=gen.runtime,
                                 prompt_cache=gen.prompt_cache or 0)
    # The generation shown has warmed specdec up; target-only's first request (its own runner, its cache's first
    # pages) is not timed either. (In this thread: llama.cpp's worker threads stay with the thread that ran a pass)
    plain.generate(args.prompt, **{**settings, "max_new_tokens": min(2, args.max_new_tokens)})
    rates = {"specdec": [], "target_only": []}
    identical = True
    with contextlib.ExitStack() as stack:
        peer = _llama_server(gen, args, stack)
        key = "llama_server"
        if peer is None:
            peer, key = _plain_llama_cpp(gen, args, stack), "llama_cpp"
        if peer is not None:
            measure, how = peer
            rates[key] = []
        for round_ in range(args.compare_rounds):
            ours = gen.generate(args.prompt, **settings, tenant=f"compare {round_}")
            baseline = plain.generate(args.prompt, **settings, tenant=f"compare {round_}")
            identical &= baseline.token_ids == out.token_ids == ours.token_ids
            rates["specdec"].append(ours.stats.tokens_per_s)
            rates["target_only"].append(baseline.stats.tokens_per_s)
            if peer is not None:
                rates[key].append(measure())
    comparison = {"rounds": args.compare_rounds, "identical": identical,
                  **{name: median(r) for name, r in rates.items()}}
    if peer is not None and key == "llama_server":
        comparison["llama_server_settings"] = how
    return comparison


def _llama_server(gen, args, stack: contextlib.ExitStack):
    """(measure() -> tokens/s, its settings in words) of upstream llama-server on the target's file, up until the
    stack closes, where `make llama-server` has built it (llama.cpp runtime, greedy, no stop strings); else None,
    and the comparison falls back to llama-cpp-python's loop."""
    import tempfile

    from specdec_exact.llama_server import default_llama_server, llama_server_session

    if gen.runtime is not LLAMA_CPP or args.temperature > 0 or args.stop:
        return None
    try:
        binary = default_llama_server()
    except FileNotFoundError:
        return None
    if not binary.is_file():
        return None
    scratch = stack.enter_context(tempfile.TemporaryDirectory())
    return stack.enter_context(llama_server_session(binary, str(gen.target.path), gen.target.threads, args.prompt,
                                                    args.max_new_tokens, args.chat, Path(scratch) / "llama-server.log"))


def _plain_llama_cpp(gen, args, stack: contextlib.ExitStack):
    """(measure() -> tokens/s, None) of llama.cpp's own greedy loop on the target's file (llama.cpp runtime, greedy
    only), loaded and warmed up until the stack closes; else None."""
    import time

    from specdec_exact.runtimes.llamacpp.peer import LlamaCppPythonPeer, plain_settings

    if gen.runtime is not LLAMA_CPP or args.temperature > 0:  # llama-cpp-python's loop: GGUF files, greedy
        return None
    prompt = gen.encode(args.prompt, args.chat)
    peer = LlamaCppPythonPeer(str(gen.target.path), plain_settings(gen.target))
    stack.callback(peer.close)
    peer.generate(prompt, min(2, args.max_new_tokens), gen.eos_ids)  # loads the model: untimed

    def measure() -> float:
        started = time.perf_counter()
        tokens = peer.generate(prompt, args.max_new_tokens, gen.eos_ids)
        return len(tokens) / (time.perf_counter() - started)

    return measure, None


def add_calibrate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure now what a first load would (exactness checks, kernel plan, pass costs), so "
                          "that later loads read it: for images, clusters and set-up scripts")
    add_generation_args(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object: the plans, widths and costs")
    parser.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    """Load the models as generate and serve do (which measures whatever this machine has not measured yet, once),
    then say what was found."""
    gen = generator_from_args(args)
    batching = gen.runtime.batching(gen.target)  # None where the runtime fuses no passes
    found = {"kernel_plans": gen.kernel_plans(), "batch_width": batching.width if batching else None,
             "pass_ms": {role: {width: round(1000 * s, 2) for width, s in costs.pass_s.items()}
                         for role, costs in (("target", gen.target_costs), ("draft", gen.draft_costs)) if costs},
             "draft_dropped": gen.draft_dropped}
    if args.json:
        print(json.dumps(found))
        return 0
    for role, plan in found["kernel_plans"].items():
        print(f"{role} kernel plan: {plan}")
    for role, costs in found["pass_ms"].items():
        shown = ", ".join(f"{width}: {ms:.1f}" for width, ms in costs.items() if width in (1, 2, 4, 8, 16))
        print(f"{role} pass of N tokens (ms): {shown}")
    if found["batch_width"] is not None:
        print(f"exact verify and batch width: {found['batch_width']} tokens")
    if gen.draft_dropped:
        print(f"draft model not used: {gen.draft_dropped}")
    if found["kernel_plans"] or found["pass_ms"]:
        print("calibrated: later loads of these models with these settings read it from the cache")
    else:
        print(f"the {gen.runtime.name} runtime keeps no calibration between loads: each load measures what it needs")
    return 0


# name -> function that adds the subcommand's parser (and sets its handler as `func`)
COMMANDS = {
    "generate": add_generate_parser,
    "models": add_models_parser,
    "calibrate": add_calibrate_parser,
    "serve": server.add_serve_parser,
    "bench": bench.add_bench_parser,
}


def main(argv: list[str] | None = None) -> int:
    return run_subcommands("specdec-exact", "Exact speculative decoding of language models.", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
