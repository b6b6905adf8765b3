"""``GET /metrics``: the server's Prometheus metrics (text format), in a registry of its own.

Gauges and totals the engine core keeps (requests running and waiting, free KV pages, tokens in and
out, preemptions, prefix-cache hits, compiled programs) are read from it at scrape time; latencies
and acceptance are recorded per request as its events arrive.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxspec.engine.programs import compiled_programs

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class _CoreCollector:
    """The core's gauges and totals, read when scraped."""

    def __init__(self, core):
        self.core = core

    def collect(self):
        s = self.core.snapshot()
        for name, key, doc in (("jaxspec_requests_running", "running", "Requests in the running batch."),
                               ("jaxspec_requests_waiting", "waiting", "Requests queued or preempted, not running."),
                               ("jaxspec_kv_pages_free", "free_pages", "Free KV pages (prefix-cache pages count)."),
                               ("jaxspec_kv_pages_total", "total_pages", "KV pages of the pool.")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        for name, key, doc in (("jaxspec_prompt_tokens", "tokens_in", "Prompt tokens of accepted requests."),
                               ("jaxspec_generation_tokens", "tokens_out", "Tokens generated."),
                               ("jaxspec_preemptions", "preemptions", "Requests taken off the batch to free pages."),
                               ("jaxspec_prefix_cache_hit_tokens", "prefix_cache_hit_tokens",
                                "Prompt positions whose KV came from the prefix cache."),
                               ("jaxspec_prefix_cache_evictions", "prefix_cache_evictions",
                                "Parked prefix-cache pages (full, window, entry) and snapshots taken back."),
                               ("jaxspec_prefix_cache_snapshots", "prefix_cache_snapshots",
                                "Recurrent-state snapshots saved by prefills (hybrid targets)."),
                               ("jaxspec_prefix_cache_snapshot_hits", "prefix_cache_snapshot_hits",
                                "Prefills that started from a recurrent-state snapshot."),
                               ("jaxspec_prefilled_tokens", "prefilled_tokens",
                                "Positions prefilled (contexts less their cached parts, resumes included)."),
                               ("jaxspec_engine_faults", "faults", "Device calls that failed (the engine restarted).")):
            yield CounterMetricFamily(name, doc, value=s[key])
        programs = GaugeMetricFamily("jaxspec_compiled_programs", "Compiled variants of each program.",
                                     labels=["program"])
        for program, count in compiled_programs().items():
            programs.add_metric([program], count)
        yield programs


class Metrics:
    def __init__(self, core, depth: int):
        self.registry = CollectorRegistry()
        self.registry.register(_CoreCollector(core))
        r = self.registry
        self.ttft = Histogram("jaxspec_time_to_first_token_seconds",
                              "From the request's arrival to its first token (the wait for the running call included).",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxspec_inter_token_latency_seconds",
                             "Time between tokens of a request, per token (a round trip's gap shared by its tokens).",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxspec_request_seconds", "From arrival to the last token.", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.accept = Histogram("jaxspec_accept_length", "Mean accept length of each finished request (tokens per "
                                "verify step, the bonus token included).", buckets=ACCEPT_BUCKETS, registry=r)
        self.verify_steps = Counter("jaxspec_verify_steps", "Verify steps of finished requests.", registry=r)
        self.accepted = Counter("jaxspec_accepted_draft_tokens", "Verify steps whose draft token at this position "
                                "was accepted (divide by jaxspec_verify_steps_total for the rate).",
                                labelnames=["position"], registry=r)
        for i in range(depth):
            self.accepted.labels(position=str(i + 1))
        self.finished = Counter("jaxspec_requests_finished", "Finished choices by finish reason.",
                                labelnames=["finish_reason"], registry=r)
        self.errors = Counter("jaxspec_http_errors", "Error responses by status.", labelnames=["status"], registry=r)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(max(seconds, 0.0))

    def tokens(self, gap: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(max(gap, 0.0) / n)

    def finish(self, stats, reason: str, seconds: float) -> None:
        self.finished.labels(finish_reason=reason).inc()
        self.e2e.observe(max(seconds, 0.0))
        if stats is not None and stats.accept_lens:
            self.accept.observe(stats.mean_accept_len)
            self.verify_steps.inc(len(stats.accept_lens))
            for i, n in enumerate(stats.accepted_per_position):
                if n:
                    self.accepted.labels(position=str(i + 1)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
