"""Prometheus metrics under vLLM's names (so its dashboards work), plus tallow: names.

Every app owns its registry (tests build several apps in one process). Engine state
(running, waiting, KV usage, prefix cache, preemptions) is read from engine.stats() at
scrape time; request and token metrics are observed as requests run (instrument.py).

Time to first token and end-to-end latency are measured from the request's arrival at the
server; queue time from the sequence's arrival at the engine to its first scheduling.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets, so histograms line up with its dashboards.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]

# Why a request was refused before it ran, by HTTP status.
REJECTION_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                     413: "body_too_large", 422: "invalid", 429: "queue_full", 503: "unavailable",
                     529: "queue_full"}  # 529: Anthropic's "overloaded"


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.model_name = ""
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Finished sequences, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Sequence latency from request arrival to "
                             "its end, in seconds.", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time a sequence waited in the "
                                    "engine's queue, in seconds.", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.aborted = Counter("tallow:requests_aborted", "Requests whose client went away before the end.",
                               labels, registry=r)
        self.failed = Counter("tallow:requests_failed", "Requests that failed with an error while running.",
                              labels, registry=r)
        self.rejected = Counter("tallow:requests_rejected", "Requests refused before they ran, by reason.",
                                labels + ["reason"], registry=r)

    def bind(self, engine, model_name: str) -> None:
        """Label everything with `model_name` and report `engine`'s state from now on."""
        self.model_name = model_name
        self.registry.register(EngineCollector(engine, model_name))

    def reject(self, status: int) -> None:
        """Count a /v1 response with `status` as a refusal, if that status is one."""
        reason = REJECTION_REASONS.get(status)
        if reason is not None:
            self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class EngineCollector(Collector):
    """Engine state read from engine.stats() at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        total = stats.get("kv_blocks_total") or 1
        usage = stats.get("kv_cache_usage", 1.0 - stats.get("kv_blocks_free", total) / total)
        yield gauge("vllm:num_requests_running", "Sequences running in the engine.", stats["running"])
        yield gauge("vllm:num_requests_waiting", "Sequences waiting in the engine's queue.", stats["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 means full).", usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.get("prefix_cache_hits", 0))
        yield counter("vllm:num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                      stats.get("num_preemptions", 0))
        spec = stats.get("speculative")
        if spec is not None:
            yield counter("vllm:spec_decode_num_drafts", "Speculative drafts verified.", spec["num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
                          spec["num_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                          spec["num_accepted_tokens"])
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Drafts whose token at this position was accepted.",
                                          labels=["model_name", "position"])
            for pos, count in enumerate(spec["accepted_per_position"]):
                per_pos.add_metric(labels + [str(pos)], count)
            yield per_pos
