"""specdec on Ray Serve: the app of `specdec-exact serve` on several replicas, in processes of one machine or across a
Ray cluster (`specdec-exact serve --replicas N`, `serve run specdec_exact.cluster:app_builder`, or application() from
Python).

One module per job:
  options.py     the flags (--replicas, --min/--max-replicas, --ray-address, --affinity-threshold), checked
  forwarding.py  a request carried to a replica and answered there by the server's own app; the front's relay
  deployment.py  the Front and Replica deployments, application() and app_builder()
  metrics.py     a replica's metrics mirrored into Ray's
  command.py     `specdec-exact serve --replicas`: starts or joins the cluster, runs the application until Ctrl-C

Ray itself is an optional dependency (`pip install specdec-exact[ray]`); only options.py imports without it.
"""


def __getattr__(name: str):
    if name in ("application", "app_builder", "APP_NAME"):
        from specdec_exact.cluster import deployment

        return getattr(deployment, name)
    raise AttributeError(name)


__all__ = ["APP_NAME", "app_builder", "application"]
