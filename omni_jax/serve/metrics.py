"""``GET /metrics``: the server's Prometheus metrics, in a registry of its own.

Counters and histograms are recorded as requests run (:class:`ServeMetrics`); the engine's
load (requests running and waiting per stage, free KV pages) is read from its latest stats at
each scrape, so a scrape never waits for a step. Names follow vLLM's where they mean the same
(``time_to_first_token_seconds``, ``e2e_request_latency_seconds``), under ``omni_jax:``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omni_jax.engine_core import EngineStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
"""Seconds: from a small model's first token on a GPU to a long spoken reply on a CPU."""


class _EngineLoad(Collector):
    """Gauges read from the engine's latest stats at scrape time."""

    def __init__(
        self, stats: Callable[[], EngineStats], waiting: Callable[[], int], compilations: Callable[[], int]
    ):
        self._stats = stats
        self._waiting = waiting
        self._compilations = compilations

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        running = GaugeMetricFamily(
            "omni_jax:num_requests_running", "Requests in a stage's batch", labels=["stage"]
        )
        waiting = GaugeMetricFamily(
            "omni_jax:num_requests_waiting", "Requests queued at a stage", labels=["stage"]
        )
        free = GaugeMetricFamily(
            "omni_jax:kv_pages_free", "Free KV cache pages of an AR stage", labels=["stage"]
        )
        total = GaugeMetricFamily(
            "omni_jax:kv_pages_capacity", "KV cache pages of an AR stage", labels=["stage"]
        )
        for name, load in stats.stages.items():
            running.add_metric([name], load.running)
            waiting.add_metric([name], load.waiting)
            if load.num_pages is not None:
                free.add_metric([name], load.free_pages)
                total.add_metric([name], load.num_pages)
        yield from (running, waiting, free, total)
        yield GaugeMetricFamily("omni_jax:num_requests", "Requests in the stage graph", value=stats.requests)
        yield GaugeMetricFamily(
            "omni_jax:queue_waiting",
            "Requests waiting for the first stage (admission and its queue): what --max-queue bounds",
            value=self._waiting(),
        )
        yield CounterMetricFamily(
            "omni_jax:xla_compilations",
            "XLA programs built (compiled, or loaded from the persistent compilation cache) since the "
            "server started, warm-up's included: flat after warm-up",
            value=self._compilations(),
        )


class ServeMetrics:
    """The server's metrics; :meth:`render` is the ``/metrics`` body."""

    def __init__(
        self, stats: Callable[[], EngineStats], waiting: Callable[[], int], compilations: Callable[[], int]
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omni_jax:request_success",
            "Requests ended, by finish reason (abort: its client went away first)",
            ["finish_reason"],
            registry=r,
        )
        self.refused = Counter(
            "omni_jax:request_refused", "Requests refused, by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter(
            "omni_jax:prompt_tokens", "Prompt tokens of requests admitted", registry=r
        )
        self.generation_tokens = Counter(
            "omni_jax:generation_tokens", "Reply text tokens produced (an aborted reply's too)", registry=r
        )
        self.audio_seconds = Counter("omni_jax:audio_seconds", "Seconds of audio produced", registry=r)
        self.ttft = Histogram(
            "omni_jax:time_to_first_token_seconds",
            "From the request's arrival to its first text",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfa = Histogram(
            "omni_jax:time_to_first_audio_seconds",
            "From the request's arrival to its first audio",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "omni_jax:e2e_request_latency_seconds",
            "From the request's arrival to its end",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineLoad(stats, waiting, compilations))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
