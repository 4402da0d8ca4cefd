"""`specdec-exact serve --replicas N` (or --min-replicas/--max-replicas): start a Ray cluster of this machine, or join
one (--ray-address), run the application on it at --host:--port until Ctrl-C or SIGTERM, then drain and shut down."""

from __future__ import annotations

import os
import signal
import sys
import threading

from specdec_exact.cluster.options import cluster_settings

# For the Ray cluster started here (one started with `ray start` takes these from its own environment):
# - Ray runs its workers, the replicas among them, at nice 15, below its own daemons, the driver and anything else on
#   the machine; the replicas are the service here, so they run at the normal priority (measured: docs/replicas-zen5).
# - On a busy machine Ray's HTTP proxy can take longer to start than Ray's 5 s readiness check allows, and Ray then
#   restarts it over and over.
RAY_DEFAULTS = {"RAY_worker_niceness": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                "RAY_USAGE_STATS_ENABLED": "0"}
AUTH_MODE = "RAY_AUTH_MODE"  # Ray's token authentication: "token" (Ray makes and keeps a token) or "disabled"


def ray_environment(args, environ) -> dict[str, str]:
    """What Ray's environment must hold for these flags (set where the environment does not say otherwise): the
    defaults above and, for the cluster started here, token authentication. A Ray cluster accepts from anyone who
    reaches its ports code to run as this user; so a cluster reachable beyond this machine (started here for a
    --host other than loopback, or joined at --ray-address) must have token authentication on, or the server
    refuses to start (ValueError, saying what to do)."""
    from specdec_exact.server.command import LOCAL_HOSTS

    wanted, mode = dict(RAY_DEFAULTS), environ.get(AUTH_MODE, "").lower()
    if args.ray_address is None:
        if mode == "disabled" and args.host not in LOCAL_HOSTS:
            raise ValueError(f"--host {args.host} with {AUTH_MODE}=disabled: the Ray cluster started for it would "
                             f"take code to run from anyone who can reach this machine; unset {AUTH_MODE} (Ray's "
                             "token authentication is then on) or serve on 127.0.0.1")
        if mode != "disabled":
            wanted[AUTH_MODE] = "token"
    elif mode != "token" and _address_host(args.ray_address) not in LOCAL_HOSTS:
        raise ValueError(f"--ray-address {args.ray_address}: a Ray cluster beyond this machine must use Ray's token "
                         f"authentication: start every node of it with {AUTH_MODE}=token and the same token "
                         "(`ray get-auth-token --generate`, then RAY_AUTH_TOKEN or ~/.ray/auth_token on each node), "
                         f"and set {AUTH_MODE}=token here too")
    return wanted


def _address_host(address: str) -> str:
    """The host of a Ray address: ray://HOST:PORT, HOST:PORT or `auto` (a cluster found on this machine, which
    may still listen on every interface: treated as reachable)."""
    rest = address.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if rest.count(":") == 1 or rest.startswith("[") else rest
    return host.strip("[]")


def run_replicated(args) -> int:
    from specdec_exact.server.command import LOCAL_HOSTS, check_serve_args, warn_if_open

    settings = cluster_settings(args)
    check_serve_args(args)
    warn_if_open(args)
    # Before Ray is imported: it reads its authentication mode once, when it loads (set later, this process would
    # start the cluster's daemons in token mode without making them a token, and they would fail)
    for name, value in ray_environment(args, os.environ).items():
        os.environ.setdefault(name, value)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'specdec-exact[ray]' (pinned: pip install -r "
                         "requirements-ray.txt)") from None
    from specdec_exact.cluster.deployment import APP_NAME, application

    if (args.api_key or args.api_key_file) and args.ray_metrics_port is not None:
        print(f"specdec: warning: the replicas' metrics at each node's port {args.ray_metrics_port} are served to "
              "anyone who reaches it, without the API key", file=sys.stderr)
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
