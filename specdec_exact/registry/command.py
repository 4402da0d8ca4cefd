"""`specdec-exact models list | pull NAME...`: the registry's subcommand."""

from __future__ import annotations

import argparse
import sys

from specdec_exact.registry.cache import cache_root
from specdec_exact.registry.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS
from specdec_exact.registry.errors import RegistryError
from specdec_exact.registry.pulling import list_models
from specdec_exact.registry.resources import GB
from specdec_exact.runtimes import RUNTIMES


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("models", help="list and download the registered models")
    parser.set_defaults(func=lambda args: _print_help(parser))
    actions = parser.add_subparsers(dest="models_action", metavar="{list,pull}")
    actions.add_parser("list", help="show registered models and whether they are installed and cached").set_defaults(
        func=_cmd_list
    )
    pull_parser = actions.add_parser("pull", help="install, verify and convert models into the cache")
    pull_parser.add_argument("names", nargs="+", metavar="NAME", help=f"one or more of: {', '.join(MODELS)}")
    pull_parser.add_argument("--quiet", action="store_true", help="no progress bars")
    pull_parser.add_argument("--runtime", choices=list(RUNTIMES), default="torch",
                             help="torch (default): also convert to an fp32 transformers checkpoint; llama.cpp: "
                                  "only install and verify the GGUF file, which that runtime reads as is")
    pull_parser.set_defaults(func=_cmd_pull)
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _cmd_list(args: argparse.Namespace) -> int:
    roles = {DEFAULT_TARGET: "default target", DEFAULT_DRAFT: "default draft"}
    print(f"{'NAME':30} {'INSTALLED':9} {'CACHED':6} {'DOWNLOAD':>8} {'ON DISK':>8}  NOTE")
    for row in list_models():
        print(f"{row.name:30} {'yes' if row.installed else 'no':9} {'yes' if row.cached else 'no':6} "
              f"{row.gguf_bytes / GB:7.2f}G {row.fp32_bytes / GB:7.2f}G  {roles.get(row.name, '')}")
    print(f"cache: {cache_root()}")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; valid names: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    for name in dict.fromkeys(args.names):  # one at a time: each conversion needs several GB of RAM
        try:
            print(RUNTIMES[args.runtime].pull(name, progress=not args.quiet))
        except RegistryError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0
