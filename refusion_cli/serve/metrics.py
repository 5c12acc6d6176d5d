"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own per server.

Names: ``refusion_queue_depth`` and ``refusion_running_rows`` (gauges), ``refusion_batch_rows`` (rows
in each model call), ``refusion_model_calls_total``, ``refusion_generated_tokens_total`` and
``refusion_forwards_total`` (forwards summed over rows: a call shared by r rows counts r times, the
toolkit's counting rule), ``refusion_stream_chunks_total`` (stream chunks that carried commits: tokens
over chunks is how many tokens a chunk carries), ``refusion_time_to_first_byte_seconds`` (request received to the first
byte of its answer: the first streamed chunk, or the whole answer), ``refusion_request_latency_seconds``,
``refusion_requests_total`` by outcome (``ok``, ``error``, ``cancelled``) and ``refusion_oom_requeues_total``
(model calls that ran out of memory and put their rows back in the queue).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from refusion_cli.decoding.stats import DecodeResult
from refusion_cli.serve.engine import EngineStats

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
SECOND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics(EngineStats):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("refusion_queue_depth", "requests waiting for a row", registry=r)
        self.running_rows = Gauge("refusion_running_rows", "rows being decoded", registry=r)
        self.batch_rows = Histogram("refusion_batch_rows", "rows in each model call", buckets=ROW_BUCKETS,
                                    registry=r)
        self.model_calls = Counter("refusion_model_calls", "model calls", registry=r)
        self.tokens = Counter("refusion_generated_tokens", "response tokens (up to and including EOS)", registry=r)
        self.forwards = Counter("refusion_forwards", "forwards, summed over rows", registry=r)
        self.ttfb = Histogram("refusion_time_to_first_byte_seconds", "request received to first byte of its answer",
                              buckets=SECOND_BUCKETS, registry=r)
        self.latency = Histogram("refusion_request_latency_seconds", "request received to answer complete",
                                 buckets=SECOND_BUCKETS, registry=r)
        self.requests = Counter("refusion_requests", "generation requests by outcome", ["outcome"], registry=r)
        self.stream_chunks = Counter("refusion_stream_chunks", "stream chunks that carried commits", registry=r)
        self.oom_requeues = Counter("refusion_oom_requeues", "model calls that ran out of memory (rows requeued)",
                                    registry=r)

    # EngineStats: called from the scheduler thread (prometheus_client is thread-safe)
    def queued(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def running(self, rows: int) -> None:
        self.running_rows.set(rows)

    def model_call(self, rows: int) -> None:
        self.model_calls.inc()
        self.batch_rows.observe(rows)

    def finished(self, result: DecodeResult) -> None:
        self.tokens.inc(result.stats.tokens)
        self.forwards.inc(result.stats.forwards)

    def oom_requeue(self) -> None:
        self.oom_requeues.inc()

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServeMetrics"]
