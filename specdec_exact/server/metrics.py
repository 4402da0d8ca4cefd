"""The server's Prometheus metrics: requests, latency and time to first token by endpoint, tokens, speculation
counts (mean accepted length and acceptance rate as specdec_exact.metrics defines them), queue depth, batch occupancy
and the prompt cache (hits, tokens reused, what it holds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from specdec_exact.metrics import SpecStats
    from specdec_exact.prompt_cache import PromptCache
    from specdec_exact.server.scheduler import Scheduler


class Metrics:
    """Prometheus metrics of one app, in its own registry (several apps may live in one process, as in the tests)."""

    def __init__(self, scheduler: Scheduler, prompt_cache: PromptCache | None = None):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.latency = Histogram("specdec_request_latency_seconds", "Request latency, a stream until its last byte",
                                 ["endpoint"], registry=registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft = Histogram("specdec_time_to_first_token_seconds",
                              "From arrival (queueing included) to the first cycle's tokens", ["endpoint"],
                              registry=registry, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished generations",
                                     registry=registry)
        self.completion_tokens = Counter("specdec_completion_tokens", "Tokens generated", registry=registry)
        self.drafted = Counter("specdec_drafted_tokens", "Draft tokens proposed", registry=registry)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted by the target", registry=registry)
        self.cycles = Counter("specdec_verify_cycles", "Verify cycles (mean accepted length = "
                              "(accepted + cycles) / cycles)", registry=registry)
        self._totals = [0, 0]  # drafted, accepted: for the acceptance-rate gauge
        Gauge("specdec_acceptance_rate", "Accepted / drafted tokens over all generations so far",
              registry=registry).set_function(lambda: self._totals[1] / self._totals[0] if self._totals[0] else 0.0)
        # What a router picks a server by (Ray Serve, KServe, llm-d's endpoint picker): requests waiting and
        # running, and how full the batch's sequence slots are.
        Gauge("specdec_queue_depth", "Requests generating or waiting for the model",
              registry=registry).set_function(lambda: scheduler.pending)
        Gauge("specdec_requests_waiting", "Requests waiting for room in the batch",
              registry=registry).set_function(lambda: scheduler.pending - scheduler.occupancy)
        Gauge("specdec_batch_occupancy", "Requests in the batch now (running: reading their prompt or decoding)",
              registry=registry).set_function(lambda: scheduler.occupancy)
        Gauge("specdec_requests_prefilling", "Requests in the batch still reading their prompt (a prefill pass per "
              "cycle, between the others' cycles)", registry=registry).set_function(lambda: scheduler.batch.prefilling)
        Gauge("specdec_model_thread_faults", "Faults of the model's thread outside a batch step (each ended the "
              "requests in the batch; the thread went on)", registry=registry).set_function(lambda: scheduler.faults)
        Gauge("specdec_batch_slots", "Requests the batch decodes at once (--max-batch): each a KV cache slot",
              registry=registry).set_function(lambda: scheduler.batch.max_batch)
        Gauge("specdec_batch_usage_ratio", "Batch occupancy / slots, 0 to 1 (the KV cache slots in use)",
              registry=registry).set_function(lambda: scheduler.occupancy / scheduler.batch.max_batch)
        self.cache_hits = Counter("specdec_prompt_cache_hits", "Generations whose prompt reused cached segments",
                                  registry=registry)
        self.cached_tokens = Counter("specdec_prompt_cache_tokens_reused",
                                     "Prompt tokens of finished generations taken from the prompt cache, not prefilled",
                                     registry=registry)
        cache = (lambda: prompt_cache.stats) if prompt_cache is not None else None
        for name, what, read in (("bytes", "Bytes of KV cache the prompt cache holds", lambda s: s.bytes),
                                 ("segments", "Prompt segments the prompt cache holds", lambda s: s.segments),
                                 ("budget_bytes", "The prompt cache's budget (--prompt-cache-mb)",
                                  lambda s: s.budget_bytes),
                                 ("evictions", "Segments evicted from the prompt cache so far", lambda s: s.evictions)):
            Gauge(f"specdec_prompt_cache_{name}", what, registry=registry).set_function(
                (lambda read=read: read(cache())) if cache is not None else (lambda: 0))
        self.request_acceptance = Histogram("specdec_request_acceptance_rate",
                                            "Per request: accepted / drafted tokens (requests that drafted)",
                                            registry=registry, buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1))

    def observe_generation(self, prompt_tokens: int, stats: SpecStats) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(stats.cached_prompt_tokens)
        self.cache_hits.inc(stats.cached_prompt_tokens > 0)
        self.completion_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.cycles.inc(stats.cycles)
        self._totals[0] += stats.drafted_tokens
        self._totals[1] += stats.accepted_tokens
        if stats.drafted_tokens:
            self.request_acceptance.observe(stats.accepted_tokens / stats.drafted_tokens)
