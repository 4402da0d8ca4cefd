"""`python -m benchmarks NAME`: the lab's benchmarks, each a subcommand registered by name."""

from __future__ import annotations

import sys

from benchmarks import conversation, interleave, kernels, load, replicas, servers
from specdec_exact.options import run_subcommands

# name -> function that adds the subcommand's parser (and sets its handler as `func`)
COMMANDS = {
    "servers": servers.add_parser,
    "conversation": conversation.add_parser,
    "interleave": interleave.add_parser,
    "replicas": replicas.add_parser,
    "load": load.add_parser,
    "kernels": kernels.add_parser,
}


def main(argv: list[str] | None = None) -> int:
    return run_subcommands("python -m benchmarks", "specdec's lab: benchmarks against other servers and "
                           "configurations.", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
