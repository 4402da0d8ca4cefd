"""`specdec serve --replicas N` (or --min-replicas/--max-replicas): start a Ray cluster of this machine, or join one
(--ray-address), run the application on it at --host:--port until Ctrl-C or SIGTERM, then drain and shut down."""

from __future__ import annotations

import os
import signal
import sys
import threading

from specdec.cluster.options import cluster_settings

# For the Ray cluster started here (one started with `ray start` takes these from its own environment):
# - Ray runs its workers, the replicas among them, at nice 15, below its own daemons, the driver and anything else on
#   the machine; the replicas are the service here, so they run at the normal priority (measured: docs/replicas-zen5).
# - On a busy machine Ray's HTTP proxy can take longer to start than Ray's 5 s readiness check allows, and Ray then
#   restarts it over and over.
RAY_DEFAULTS = {"RAY_worker_niceness": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                "RAY_USAGE_STATS_ENABLED": "0"}


def run_replicated(args) -> int:
    from specdec.server.command import LOCAL_HOSTS, check_serve_args, warn_if_open

    settings = cluster_settings(args)
    check_serve_args(args)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'specdec[ray]' (pinned: pip install -r "
                         "requirements-ray.txt)") from None
    from specdec.cluster.deployment import APP_NAME, application

    warn_if_open(args)
    for name, value in RAY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level="WARNING")
    else:
        local = args.host in LOCAL_HOSTS
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING",
                 _node_ip_address="127.0.0.1" if local else None,
                 _metrics_export_port=args.ray_metrics_port)
    # SIGTERM drains and stops too, as Ctrl-C does (set after ray.init, which puts in a handler of its own that ends
    # the process at once and strands the cluster's processes)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        count = (f"{settings['replicas']} replicas" if settings["max_replicas"] is None else
                 f"{settings['min_replicas']} to {settings['max_replicas']} replicas (autoscaling)")
        print(f"specdec: starting {count} of {settings['threads']} thread(s) each; each loads the models once",
              file=sys.stderr)
        serve.run(application(args, **settings), name=APP_NAME, route_prefix="/")
        metrics = (f"; metrics of every replica at each node's Ray metrics port"
                   f"{f' (here: {args.ray_metrics_port})' if args.ray_metrics_port else ''}")
        print(f"specdec: serving at http://{args.host}:{args.port}{metrics}. Ctrl-C stops", file=sys.stderr,
              flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        print("specdec: draining (requests in flight finish, up to --request-timeout; Ctrl-C again stops at once)",
              file=sys.stderr, flush=True)
        # Deleting the application first drains it: Ray stops the front and the replicas once their requests in
        # flight are answered, while its HTTP proxy stays up to send those answers. serve.shutdown alone kills the
        # proxy at once and cuts every connection.
        serve.delete(APP_NAME)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
