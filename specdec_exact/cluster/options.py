"""The flags of `specdec-exact serve` that put its app on Ray Serve replicas (importable without Ray installed)."""

from __future__ import annotations

import argparse
import os


# Any of these given: the app runs on Ray Serve.
CLUSTER_FLAGS = ("replicas", "min_replicas", "max_replicas", "ray_address", "ray_metrics_port", "affinity_threshold")


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "replicas on Ray Serve", "Serve the same app from several processes or machines, each loading the models once "
                                 "and decoding its own batch; Ray routes the requests (needs `pip install "
                                 "specdec-exact[ray]`)")
    group.add_argument("--replicas", type=int, default=None,
                       help="this many replicas (default: one process, no Ray)")
    group.add_argument("--min-replicas", type=int, default=None,
                       help="with --max-replicas: Ray Serve adds and removes replicas between the two as the "
                            "requests each one holds go above or below --max-batch (default: 1)")
    group.add_argument("--max-replicas", type=int, default=None,
                       help="the most replicas autoscaling starts (see --min-replicas)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (`auto`, or the HEAD:6379 that `ray start --head` printed); "
                            "default: start a Ray cluster of this machine alone, ended with the server")
    group.add_argument("--ray-metrics-port", type=int, default=None,
                       help="the port at which the Ray cluster started here exports every replica's metrics in "
                            "Prometheus format (default: one Ray picks; `ray start --metrics-export-port` for "
                            "a cluster of your own)")
    group.add_argument("--affinity-threshold", type=float, default=None, metavar="REQUESTS",
                       help="a request goes to the replica whose prompt cache holds the most of its prompt unless "
                            "that replica holds this many requests more than the least loaded one; then to the less "
                            "loaded of two (default: --max-batch)")


def cluster_settings(args) -> dict:
    """The replica count or autoscaling bounds and the threads per replica that the flags ask for, checked -> keyword
    arguments of specdec_exact.cluster.application. Bad combinations: ValueError, saying what to pass instead."""
    fixed, low, high = args.replicas, args.min_replicas, args.max_replicas
    if fixed is not None and (low is not None or high is not None):
        raise ValueError("--replicas is a fixed count: pass it alone, or --min-replicas/--max-replicas to autoscale")
    if low is not None and high is None:
        raise ValueError("--min-replicas needs --max-replicas: the most replicas autoscaling may start")
    if fixed is not None and fixed < 1:
        raise ValueError(f"--replicas must be at least 1, got {fixed}")
    low = 1 if low is None and high is not None else low
    if high is not None and not 0 <= low <= high or high == 0:
        raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got {low} and {high}")
    if fixed is None and high is None:
        fixed = 1  # another flag of this group alone (--ray-address): one replica
    most = fixed or high
    # Each replica reserves its threads as Ray CPUs, so that Ray never puts more replicas on a node than its cores
    # can run without fighting; by default the replicas share this machine's cores.
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // most)
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    threshold = args.affinity_threshold  # None: the application's default, --max-batch
    if threshold is not None and threshold < 0:
        raise ValueError(f"--affinity-threshold must be >= 0 requests, got {threshold:g}")
    return dict(replicas=fixed, min_replicas=low, max_replicas=high, threads=threads, affinity_threshold=threshold)
