"""`specdec-exact serve`: its flags, and the command that loads the models once and serves them with uvicorn."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec_exact.cluster.options import CLUSTER_FLAGS, add_cluster_args
from specdec_exact.generator import DEFAULT_MAX_BATCH
from specdec_exact.options import add_generation_args, add_prompt_cache_arg, generator_from_args
from specdec_exact.server.app import create_app
from specdec_exact.server.limits import CTX_STEP, MEMORY_SHARE
from specdec_exact.server.scheduler import DEFAULT_MAX_QUEUE, DEFAULT_REQUEST_TIMEOUT_S
from specdec_exact.server.starting import Starting


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # --host values that only this machine can reach
API_KEY_VARIABLE = "SPECDEC_API_KEY"  # --api-key's default


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the models over an OpenAI-compatible HTTP API")
    add_generation_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE),
                        help="require `Authorization: Bearer KEY` on every route but /health "
                             f"(default: ${API_KEY_VARIABLE}, else no key; on the command line other users of the "
                             "machine can read it: prefer the variable or --api-key-file)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="accept any of the keys in FILE, one a line (blank lines and lines starting with # are "
                             "skipped), beside --api-key: several clients with keys of their own, and no key on the "
                             "command line. Each key's requests reuse only that key's cached prompts and answers and "
                             "draft only from that key's earlier text, unless --share-across-keys")
    parser.add_argument("--share-across-keys", action="store_true",
                        help="with several keys, let every key's requests reuse all cached prompts and draft from "
                             "all earlier text: faster where clients send the same documents, but a client can then "
                             "tell from a cache hit or a draft's acceptance what another key's clients sent")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                        help="requests decoded together, each drafting with its own fork of the drafter, their "
                             "target passes fused where the runtime can; 1 serves one at a time. Refused at start "
                             "when their KV caches at --ctx-size do not fit in memory (default: %(default)s)")
    parser.add_argument("--ctx-size", type=int, default=None,
                        help="tokens one request may hold, prompt and completion together; prompts are checked "
                             "against it and /v1/models reports it as max_model_len (default: what memory allows: "
                             f"the largest multiple of {CTX_STEP} tokens, at most the target's trained context, for "
                             f"which --max-batch requests' KV caches fit in {MEMORY_SHARE:.0%}% of the available "
                             "memory, less the prompt cache's budget and the copies a prefill through it makes)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait while the batch is full; more get 503 (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="SECONDS",
                        help="a request still queued or generating after this long ends with 504 (streamed: an "
                             "error event) and leaves the batch (default: %(default)g)")
    add_prompt_cache_arg(parser)
    parser.add_argument("--model-name", default=None,
                        help="the `model` clients send (default: the --target value)")
    add_cluster_args(parser)
    parser.set_defaults(func=run_serve)


def serve_arguments(argv: list[str]):
    """The flags of `specdec-exact serve` parsed from argv, with their defaults (a bad flag: SystemExit, as on the
    command line)."""
    import argparse

    parser = argparse.ArgumentParser(prog="specdec-exact")
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def app_from_args(args, key_digests: Sequence[bytes] = ()):
    """The app that the flags of `specdec-exact serve` describe, its models loaded once (here): what `specdec-exact
    serve` runs on uvicorn and every Ray Serve replica runs in its own process (specdec_exact.cluster, which passes the
    keys as key_digests, the flags without them). Bad flags: ValueError."""
    check_serve_args(args)
    generator = generator_from_args(args, args.prompt_cache_mb)  # loaded once, shared by every request
    return create_app(generator, args.model_name or args.target, api_keys(args), args.max_queue, args.max_batch,
                      ctx_size=args.ctx_size, request_timeout=args.request_timeout,
                      share_across_keys=getattr(args, "share_across_keys", False), key_digests=key_digests)


def api_keys(args) -> list[str]:
    """The keys the server accepts: --api-key and the lines of --api-key-file (none: no key is asked for)."""
    keys = [args.api_key] if args.api_key else []
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            lines = Path(path).expanduser().read_text().splitlines()
        except OSError as error:
            raise ValueError(f"--api-key-file {path}: cannot read it ({error.strerror or error})") from None
        found = [key for key in map(str.strip, lines) if key and not key.startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {path} holds no key: write one key a line")
        keys += found
    return keys


def check_serve_args(args) -> None:
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout:g}")
    api_keys(args)  # a key file that cannot be read or holds no key: refused before the models load


def run_serve(args) -> int:
    """Bind the port first, then load the models behind it (/health: 503 "calibrating" or "loading", with the
    progress, until they serve: server.starting); a load that fails stops the server and is raised here."""
    if any(getattr(args, flag) is not None for flag in CLUSTER_FLAGS):
        from specdec_exact.cluster.command import run_replicated

        return run_replicated(args)
    import uvicorn

    check_serve_args(args)
    warn_if_open(args)
    starting = Starting(args.model_name or args.target)
    server = uvicorn.Server(uvicorn.Config(starting, host=args.host, port=args.port))

    def build():
        app = app_from_args(args)
        service = app.state.service
        print(f"specdec: ready: up to {service.scheduler.batch.max_batch} requests at once (--max-batch), each of "
              f"up to {service.context} tokens (--ctx-size)", file=sys.stderr)
        return app

    starting.start(build, on_failure=lambda: setattr(server, "should_exit", True))
    server.run()
    if starting.failure is not None:
        raise starting.failure
    return 0


def warn_if_open(args) -> None:
    if not args.api_key and not getattr(args, "api_key_file", None) and args.host not in LOCAL_HOSTS:
        print(f"specdec: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    if args.api_key and args.api_key != os.environ.get(API_KEY_VARIABLE):
        print(f"specdec: warning: an --api-key given on the command line can be read by every user of this machine "
              f"(ps, /proc); set {API_KEY_VARIABLE} or use --api-key-file instead", file=sys.stderr)
