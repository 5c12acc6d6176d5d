"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own per server.

Names: ``refusion_queue_depth`` and ``refusion_running_rows`` (gauges), ``refusion_batch_rows`` (rows
in each model call), ``refusion_model_calls_total``, ``refusion_generated_tokens_total`` and
``refusion_forwards_total`` (forwards summed over rows: a call shared by r rows counts r times, the
toolkit's counting rule), ``refusion_stream_chunks_total`` (stream chunks that carried commits: tokens
over chunks is how many tokens a chunk carries), ``refusion_time_to_first_byte_seconds`` (request received to the first
byte of its answer: the first streamed chunk, or the whole answer), ``refusion_request_latency_seconds``,
``refusion_requests_total`` by outcome (``ok``, ``error``, ``cancelled``) and ``refusion_oom_requeues_total``
(model calls that ran out of memory and put their rows back in the queue).

Labels, as vLLM's ``model_name``: the series of requests (tokens, forwards, chunks, the two times, requests) carry
``model`` (the checkpoint) and ``decoder`` (the served model id: the decoder and ReFusion's variant); the model
calls' and the queue's series carry ``model``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from refusion_cli.serve.engine import EngineStats

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
SECOND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REQUEST = ["model", "decoder"]  # the labels of a request's series
OUTCOMES = ("ok", "error", "cancelled")


class ServeMetrics(EngineStats):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("refusion_queue_depth", "requests waiting for a row", ["model"], registry=r)
        self.running_rows = Gauge("refusion_running_rows", "rows being decoded", ["model"], registry=r)
        self.batch_rows = Histogram("refusion_batch_rows", "rows in each model call", ["model"], buckets=ROW_BUCKETS,
                                    registry=r)
        self.model_calls = Counter("refusion_model_calls", "model calls", ["model"], registry=r)
        self.tokens = Counter("refusion_generated_tokens", "response tokens (up to and including EOS)", REQUEST,
                              registry=r)
        self.forwards = Counter("refusion_forwards", "forwards, summed over rows", REQUEST, registry=r)
        self.ttfb = Histogram("refusion_time_to_first_byte_seconds", "request received to first byte of its answer",
                              REQUEST, buckets=SECOND_BUCKETS, registry=r)
        self.latency = Histogram("refusion_request_latency_seconds", "request received to answer complete",
                                 REQUEST, buckets=SECOND_BUCKETS, registry=r)
        self.requests = Counter("refusion_requests", "generation requests by outcome", ["outcome", *REQUEST],
                                registry=r)
        self.stream_chunks = Counter("refusion_stream_chunks", "stream chunks that carried commits", REQUEST,
                                     registry=r)
        self.oom_requeues = Counter("refusion_oom_requeues", "model calls that ran out of memory (rows requeued)",
                                    ["model"], registry=r)

    def serve(self, model: str, decoder: str) -> None:
        """Start the series of ``decoder`` on ``model`` at zero: a scrape shows them before the first request."""
        for series in (self.queue_depth, self.running_rows, self.batch_rows, self.model_calls, self.oom_requeues):
            series.labels(model)
        for series in (self.tokens, self.forwards, self.ttfb, self.latency, self.stream_chunks):
            series.labels(model, decoder)
        for outcome in OUTCOMES:
            self.requests.labels(outcome, model, decoder)

    # EngineStats: called from the scheduler thread (prometheus_client is thread-safe)
    def queued(self, model: str, depth: int) -> None:
        self.queue_depth.labels(model).set(depth)

    def running(self, model: str, rows: int) -> None:
        self.running_rows.labels(model).set(rows)

    def model_call(self, model: str, rows: int) -> None:
        self.model_calls.labels(model).inc()
        self.batch_rows.labels(model).observe(rows)

    def oom_requeue(self, model: str) -> None:
        self.oom_requeues.labels(model).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServeMetrics"]
