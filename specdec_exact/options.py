"""The flags that choose models and decoding, shared by every front end that generates (specdec-exact generate, serve,
bench; the lab's load), the generator they describe, and the running of a command line of subcommands. The front
ends import this module, never each other."""

from __future__ import annotations

import argparse
import sys

from specdec_exact import progress, registry
from specdec_exact.runtimes import RUNTIMES, pick_runtime


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """Model and sampling flags shared by the commands that generate (generate, serve, bench)."""
    parser.add_argument("--target", default=registry.DEFAULT_TARGET,
                        help="registry name, transformers directory or .gguf file (default: %(default)s)")
    parser.add_argument("--draft", default=registry.DEFAULT_DRAFT,
                        help="draft model (like --target), a drafter name, or 'none' for target-only decoding "
                             "(default: %(default)s)")
    parser.add_argument("--runtime", choices=["auto", *RUNTIMES], default="auto",
                        help="llama.cpp: GGUF weights on llama.cpp's CPU kernels; torch: transformers; auto "
                             "(default): llama.cpp for registry models and .gguf files when it is installed")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per model (default: every core this process may use). On a shared "
                             "machine fewer threads than cores can be faster: a multi-token pass waits at each "
                             "barrier for a thread that is not running")
    # int8 drafts measured 1.21x over target-only at k=4 with the default pair, fp32 drafts 0.95x
    # (docs/benchmarks-history.md).
    parser.add_argument("--quantize-draft", choices=["auto", "int8", "none"], default="auto",
                        help="torch runtime: weights of a draft model, int8 (cheaper drafts, output unchanged) or "
                             "none (as loaded); auto (default): int8 on torch, the GGUF's own on llama.cpp")
    parser.add_argument("--quantize-target", choices=["int8"], default=None,
                        help="torch runtime: int8 weights for the target: a slightly different model, much faster, "
                             "and a nearly flat verify cost; output is exact relative to the int8 target")
    parser.add_argument("--k", default="auto",
                        help="draft tokens per cycle, or 'auto' (default): chosen every cycle from the measured "
                             "acceptance and costs, 0 (plain decoding) where speculation cannot pay")


def add_prompt_cache_arg(parser: argparse.ArgumentParser) -> None:
    """--prompt-cache-mb, for the commands that serve requests (serve, load)."""
    from specdec_exact.prompt_cache import DEFAULT_BUDGET_MB

    parser.add_argument("--prompt-cache-mb", type=float, default=DEFAULT_BUDGET_MB, metavar="MB",
                        help="memory for the KV cache of earlier requests' prompts, so that a prompt that starts "
                             "like an earlier one (a conversation's next turn, an agent's instructions) prefills only "
                             "the rest; answers stay exactly those of an uncached prompt. Least recently used blocks "
                             "go first; 0 turns it off (default: %(default)g)")


def generator_from_args(args, prompt_cache: float = 0, keep_draft: bool = False):
    """The SpeculativeGenerator that the flags of add_generation_args describe (models loaded once, here), with a
    prompt cache of prompt_cache MB (default: none, for the commands that time single prompts); keep_draft: a draft
    model that cannot pay on this machine is kept (SpeculativeGenerator's keep_draft)."""
    from specdec_exact.generator import SpeculativeGenerator

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    runtime = pick_runtime(args.runtime, args.target)
    draft_quantization = {"auto": runtime.default_draft_quantization, "none": None}.get(args.quantize_draft,
                                                                                     args.quantize_draft)
    draft = None if args.draft == "none" else args.draft
    drafting = "target-only" if draft is None else f"draft {draft}"  # (which may yet be left out: see the load)
    with progress.step(f"loading {args.target}, {drafting}, on {runtime.name}"):
        gen = SpeculativeGenerator(args.target, draft, k=args.k, target_quantization=args.quantize_target,
                                   draft_quantization=draft_quantization, runtime=runtime, threads=args.threads,
                                   prompt_cache=prompt_cache, keep_draft=keep_draft)
    if gen.cross_vocabulary:
        print(f"specdec: {gen.cross_vocabulary}", file=sys.stderr)
    return gen


def run_subcommands(prog: str, description: str, commands: dict, argv: list[str] | None = None) -> int:
    """Parse a command line of subcommands (name -> function that adds the subcommand's parser and sets its handler
    as `func`) and run the chosen one -> its exit code: 2 after an error in what was asked (a message, no
    traceback), 130 after Ctrl-C."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in commands.values():
        add_parser(subparsers)
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # per-tensor loading bars of a cached model flash by in 0.1 s
    progress.log_to_stderr()  # what a long step (a calibration, a load) is doing, and its ETA
    name = prog.split()[-1]
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, registry.RegistryError) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
