"""attnx serve's Prometheus metrics (GET /metrics), in a registry of the server's own: requests by outcome, prompt and
new tokens, time to first token and time between tokens (histograms), the queue's depth and the batch's rows."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Metrics"]

# Seconds: a token on a small model on one core takes ~1 ms, a prompt of thousands on a big one seconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The counters, histograms and gauges of one server; waiting() and running() are read when scraped."""

    def __init__(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.requests = prom.Counter("attnx_requests", "Requests answered, by outcome: stop, length, abort, "
                                     "cancelled (the client left), error, bad_request, not_found, queue_full, "
                                     "unavailable", ["outcome"], registry=r)  # fmt: skip
        self.prompt_tokens = prom.Counter("attnx_prompt_tokens", "Prompt tokens of the requests served", registry=r)
        self.new_tokens = prom.Counter("attnx_generation_tokens", "New tokens made", registry=r)
        self.ttft = prom.Histogram("attnx_time_to_first_token_seconds", "From a request's arrival to its first new "
                                   "token", buckets=_TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tbt = prom.Histogram("attnx_time_between_tokens_seconds", "Between two new tokens of one request",
                                  buckets=_TBT_BUCKETS, registry=r)  # fmt: skip
        queue = prom.Gauge("attnx_queue_depth", "Requests waiting to join the batch", registry=r)
        queue.set_function(waiting)
        rows = prom.Gauge("attnx_batch_rows", "Requests in the batch (rows decoded each step)", registry=r)
        rows.set_function(running)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        import prometheus_client as prom

        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
