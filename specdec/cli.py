"""`specdec` command line: subcommands are registered by name, each with its own parser and handler."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec import bench, registry, server
from specdec.options import add_generation_args, generator_from_args
from specdec.registry.command import add_models_parser
from specdec.runtimes import LLAMA_CPP

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome."


def add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text with speculative decoding")
    add_generation_args(parser)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a short coding task)")
    parser.add_argument("--chat", action="store_true", help="apply the target's chat template to the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    parser.add_argument("--compare", action="store_true",
                        help="also run target-only decoding on the same prompt and report the measured speed-up")
    parser.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from specdec.generator import SpeculativeGenerator

    gen = generator_from_args(args)
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat)
    # Target-only shares the prompt cache: each is timed warm, as llama-server's slot is after its warm-up
    plain = SpeculativeGenerator(gen.target, None, tokenizer=gen.tokenizer, runtime=gen.runtime,
                                 prompt_cache=gen.prompt_cache or 0)
    if args.compare:  # untimed warm-up of both: the first pass over freshly loaded weights is slower
        for warm in (gen, plain):
            warm.generate(args.prompt, **{**settings, "max_new_tokens": min(2, args.max_new_tokens)})
    out = gen.generate(args.prompt, **settings)
    baseline = plain.generate(args.prompt, **settings) if args.compare else None
    llama_server = _llama_server(gen, args) if args.compare else None
    llama_cpp = _plain_llama_cpp(gen, args, settings) if args.compare and llama_server is None else None
    if args.json:
        record = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "stats": out.stats.to_dict(), "cross_vocabulary": gen.cross_vocabulary,
                  "kernel_plans": gen.kernel_plans()}
        if baseline is not None:
            record["baseline"] = {"tokens_per_s": baseline.stats.tokens_per_s,
                                  "identical": baseline.token_ids == out.token_ids,
                                  "speedup": out.stats.tokens_per_s / baseline.stats.tokens_per_s}
        if llama_server is not None:
            rate, how = llama_server
            record["llama_server"] = {"tokens_per_s": rate, "speedup": out.stats.tokens_per_s / rate,
                                      "settings": how}
        if llama_cpp is not None:
            record["llama_cpp"] = {"tokens_per_s": llama_cpp, "speedup": out.stats.tokens_per_s / llama_cpp}
        print(json.dumps(record))
        return 0
    from specdec.display import print_marked, summary_line

    print_marked(gen.tokenizer, out.token_ids, out.from_draft)
    print(summary_line(out.stats, args.draft != "none"))
    if baseline is not None:
        same = "identical output" if baseline.token_ids == out.token_ids else "different samples"
        print(f"target-only: {baseline.stats.tokens_per_s:.2f} tokens/s -> speed-up "
              f"{out.stats.tokens_per_s / baseline.stats.tokens_per_s:.2f}x ({same})")
    if llama_server is not None:
        rate, how = llama_server
        print(f"upstream llama-server (unpatched, {how}, same file, over HTTP): {rate:.2f} tokens/s "
              f"-> speed-up {out.stats.tokens_per_s / rate:.2f}x")
    if llama_cpp is not None:
        print(f"plain llama.cpp (llama-cpp-python's own loop, its default settings, same file): {llama_cpp:.2f} "
              f"tokens/s -> speed-up {out.stats.tokens_per_s / llama_cpp:.2f}x (build upstream llama-server with "
              "`make llama-server` to compare with it instead)")
    if args.compare:
        for role, plan in gen.kernel_plans().items():
            print(f"kernel plan ({role}, passes of 1-16 tokens): {plan}")
    return 0


def _llama_server(gen, args) -> tuple[float, str] | None:
    """(tokens/s, its settings in words) of upstream llama-server on the target's file, where `make llama-server` has
    built it (llama.cpp runtime, greedy, no stop strings); else None, and the comparison falls back to
    llama-cpp-python's loop."""
    import tempfile

    from specdec.bench.servers import default_llama_server, llama_server_rate

    if gen.runtime is not LLAMA_CPP or args.temperature > 0 or args.stop:
        return None
    try:
        binary = default_llama_server()
    except FileNotFoundError:
        return None
    if not binary.is_file():
        return None
    with tempfile.TemporaryDirectory() as scratch:
        return llama_server_rate(binary, str(gen.target.path), gen.target.threads, args.prompt, args.max_new_tokens,
                                 args.chat, Path(scratch) / "llama-server.log")


def _plain_llama_cpp(gen, args, settings: dict) -> float | None:
    """Tokens/s of llama.cpp's own greedy loop on the target's file (llama.cpp runtime, greedy only), warmed up."""
    import time

    from specdec.runtimes.llamacpp.peer import LlamaCppPythonPeer, plain_settings

    if gen.runtime is not LLAMA_CPP or args.temperature > 0:  # llama-cpp-python's loop: GGUF files, greedy
        return None
    prompt = gen.encode(args.prompt, args.chat)
    peer = LlamaCppPythonPeer(str(gen.target.path), plain_settings(gen.target))
    try:
        peer.generate(prompt, min(2, args.max_new_tokens), gen.eos_ids)  # loads the model: untimed
        started = time.perf_counter()
        tokens = peer.generate(prompt, args.max_new_tokens, gen.eos_ids)
        return len(tokens) / (time.perf_counter() - started)
    finally:
        peer.close()


# name -> function that adds the subcommand's parser (and sets its handler as `func`)
COMMANDS = {
    "generate": add_generate_parser,
    "models": add_models_parser,
    "serve": server.add_serve_parser,
    "bench": bench.add_bench_parser,
    "load": bench.add_load_parser,
    "bench-servers": bench.add_bench_servers_parser,
    "bench-conversation": bench.add_bench_conversation_parser,
    "bench-interleave": bench.add_bench_interleave_parser,
    "bench-replicas": bench.add_bench_replicas_parser,
    "kernels": bench.add_kernels_parser,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding of language models.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in COMMANDS.values():
        add_parser(subparsers)
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # per-tensor loading bars of a cached model flash by in 0.1 s
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, registry.RegistryError) as error:
        print(f"specdec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
