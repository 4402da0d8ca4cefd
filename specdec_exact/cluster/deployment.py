"""The Ray Serve application: a front that relays HTTP requests and the replicas that answer them.

  Front    the ingress (no CPU of its own): checks the API key from the headers before any of the body is read,
           then reads each request and hands it, through a Ray Serve handle, to a replica chosen by Ray's
           PrefixCacheAffinityRouter: the replica that served the longest start of this prompt (a conversation goes
           back to the replica whose prompt cache holds it), unless that one holds `affinity_threshold` requests
           more than the least loaded; then the less loaded of two (power of two choices). Answers stream back as
           the replica sends them (forwarding.Relay).
  Replica  one `specdec-exact serve` app (server.command.app_from_args): the models loaded once, its own continuous
           batch and prompt cache, `threads` CPUs reserved in Ray so that replicas on one node do not share cores.
           Ray restarts one that dies or fails its health check, and drains one that stops (requests in flight
           finish first, up to the request timeout).

Its metrics (every one of `specdec-exact serve`'s, tagged by replica) go to Ray's own metrics, which each node exports
in Prometheus format (ray_specdec_*; `ray start --metrics-export-port`), beside Ray Serve's request gauges; Ray
exports them to anyone, so with API keys only where --ray-metrics-port asks for them. The keys themselves travel
only as digests (middleware.key_digest).
"""

from __future__ import annotations

import argparse
import threading

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from specdec_exact.cluster.forwarding import ForwardedRequest, Relay, answer
from specdec_exact.cluster.metrics import mirror_to_ray
from specdec_exact.server.middleware import MAX_BODY_BYTES, Authenticate, LimitBody, key_digest

APP_NAME = "specdec"
# Ray's router that prefers the replica which saw the longest start of the prompt (it reads the `prompt` attribute
# of ForwardedRequest). Ray exports it publicly as ray.serve.llm.request_router only beside vLLM or SGLang, so this is
# its module; ray is pinned (requirements-ray.txt).
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
HEALTH_CHECK_PERIOD_S = 5.0
REPLICA_LOST = (RayActorError, ActorUnavailableError, ReplicaUnavailableError, DeploymentUnavailableError)


@serve.deployment(name="Replica")
class Replica:
    def __init__(self, flags: dict, key_digests: list[bytes], mirror_metrics: bool):
        """flags: `specdec-exact serve`'s, without the keys; key_digests: the keys' (middleware.key_digest): the replica
        checks a request's key again and knows its tenant; mirror_metrics: into Ray's, which every node exports
        without any key."""
        from specdec_exact.server.command import app_from_args

        self.app = app_from_args(argparse.Namespace(**flags), key_digests)
        self.service = self.app.state.service
        if mirror_metrics:
            threading.Thread(target=mirror_to_ray, args=(self.service.metrics.registry,), name="specdec-metrics",
                             daemon=True).start()

    async def answer(self, request: ForwardedRequest):
        async for message in answer(self.app, request):
            yield message

    def check_health(self) -> None:
        failure = self.service.scheduler.failure
        if failure is not None:
            raise RuntimeError(f"{failure}: this replica cannot decode")


@serve.deployment(name="Front", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress()
class Front:
    def __init__(self, replicas, key_digests: list[bytes]):
        self.replicas = replicas.options(stream=True)
        self.key_digests = key_digests

    def __serve_build_asgi_app__(self):
        return front_app(self.forward, self.key_digests)

    def forward(self, request: ForwardedRequest):
        return self.replicas.answer.remote(request)


def front_app(forward, key_digests: list[bytes]):
    """The front's ASGI app: the relay to the replicas (`forward`: Relay's), behind the body's limit and, with keys,
    behind the key: a request without one is refused from its headers, before anything of its body is read or held
    here."""
    app = LimitBody(Relay(forward, REPLICA_LOST, (BackPressureError,)), MAX_BODY_BYTES)
    return Authenticate(app, key_digests) if key_digests else app


def application(flags: argparse.Namespace, replicas: int | None = None, min_replicas: int | None = None,
                max_replicas: int | None = None, threads: int = 1, affinity_threshold: float | None = None
                ) -> serve.Application:
    """The Ray Serve application of `specdec-exact serve`'s flags (a Namespace as server.command.serve_arguments gives):
    `replicas` replicas, or autoscaling between min_replicas and max_replicas on the requests each holds (target:
    --max-batch), each with `threads` threads and as many Ray CPUs. Run it with ray.serve.run(app, name=APP_NAME).

    The API keys (--api-key, --api-key-file, read here) reach the front and the replicas as digests only; with keys,
    the replicas' metrics go into Ray's exported metrics (which need no key) only when --ray-metrics-port asks."""
    from specdec_exact.server.command import api_keys

    digests = [key_digest(key) for key in api_keys(flags)]
    settings = {key: value for key, value in vars(flags).items() if key != "func"}
    settings.update(threads=threads, api_key=None, api_key_file=None)
    mirror_metrics = not digests or getattr(flags, "ray_metrics_port", None) is not None
    scaling = ({"num_replicas": replicas} if max_replicas is None else
               {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                       "initial_replicas": max(min_replicas, 1),
                                       "target_ongoing_requests": flags.max_batch}})
    threshold = flags.max_batch if affinity_threshold is None else affinity_threshold
    replica = Replica.options(
        **scaling, ray_actor_options={"num_cpus": threads},
        # The replica's own queue (--max-queue) answers 503 when full, as a single server does; Ray holds no more.
        max_ongoing_requests=flags.max_batch + max(flags.max_queue, 1), max_queued_requests=max(flags.max_queue, 1),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_wait_loop_s=1.0, graceful_shutdown_timeout_s=flags.request_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class=PREFIX_ROUTER,
            request_router_kwargs={"imbalanced_threshold": threshold, "do_eviction": True}))
    # The front holds every request in flight too: on shutdown it waits for them as the replicas do.
    front = Front.options(graceful_shutdown_wait_loop_s=1.0, graceful_shutdown_timeout_s=flags.request_timeout)
    return front.bind(replica.bind(settings, digests, mirror_metrics), digests)


def app_builder(args: dict) -> serve.Application:
    """For `serve run specdec_exact.cluster:app_builder flags="--target ... --draft ngram" replicas=2` and `serve run
    CONFIG.yaml` (import_path: specdec_exact.cluster:app_builder, args: flags, replicas, min_replicas, max_replicas,
    threads, affinity_threshold): the application of those `specdec-exact serve` flags."""
    from specdec_exact.cluster.options import cluster_settings
    from specdec_exact.server.command import serve_arguments

    unknown = set(args) - {"flags", "replicas", "min_replicas", "max_replicas", "threads", "affinity_threshold"}
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)}: pass `specdec-exact serve` flags as flags=\"...\"")
    flags = serve_arguments(str(args.get("flags", "")).split())
    for key in ("replicas", "min_replicas", "max_replicas", "threads"):
        if args.get(key) is not None:
            setattr(flags, key, int(args[key]))
    if args.get("affinity_threshold") is not None:
        flags.affinity_threshold = float(args["affinity_threshold"])
    if flags.replicas is None and flags.max_replicas is None:
        flags.replicas = 1
    return application(flags, **cluster_settings(flags))
