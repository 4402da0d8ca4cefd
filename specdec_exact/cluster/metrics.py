"""A replica's Prometheus metrics mirrored into Ray's, which every node exports with the replica's tags: the router
gauges (waiting, running, batch usage), the speculation counters and the rest of `specdec-exact serve`'s /metrics."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry

log = logging.getLogger("specdec.cluster")

MIRROR_PERIOD_S = 2.0


def mirror_to_ray(registry: CollectorRegistry, period_s: float = MIRROR_PERIOD_S, rounds: int | None = None) -> None:
    """Every period_s, set a Ray Serve gauge to each sample of the registry (a counter's total, a histogram's buckets,
    sum and count: their Prometheus names and labels, the replica's tags added by Ray). Runs in a thread of its own
    for `rounds` rounds (None: for the replica's life)."""
    from ray.serve import metrics

    gauges: dict[tuple[str, tuple[str, ...]], metrics.Gauge] = {}
    done = 0
    while rounds is None or done < rounds:
        try:
            for family in registry.collect():
                for sample in family.samples:
                    if sample.name.endswith("_created"):  # prometheus_client's creation timestamps
                        continue
                    keys = tuple(sorted(sample.labels))
                    gauge = gauges.get((sample.name, keys))
                    if gauge is None:
                        gauge = gauges[sample.name, keys] = metrics.Gauge(sample.name, family.documentation,
                                                                          tag_keys=keys)
                    gauge.set(sample.value, tags=dict(sample.labels) or None)
        except Exception:  # a metric must never take the replica down
            log.exception("mirroring the metrics to Ray failed")
        done += 1
        time.sleep(period_s)
