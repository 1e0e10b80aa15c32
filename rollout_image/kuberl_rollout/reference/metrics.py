"""GET /metrics with SGLang's names, for what the reference engine can measure (SGLang serves
them with --enable-metrics; so does this engine). A Prometheus dashboard or alert written for
SGLang engines reads these the same way:

  sglang:num_running_reqs          gauge    requests in the running batch
  sglang:num_queue_reqs            gauge    requests waiting (queued, or held by a pause)
  sglang:prompt_tokens_total       counter  prompt tokens of finished requests
  sglang:generation_tokens_total   counter  tokens generated for finished requests
  sglang:num_requests_total        counter  finished requests

each labelled model_name (the served model's path, SGLang's default served name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Queues(Collector):
    def __init__(self, model_name: str, running: Callable[[], int],
                 queued: Callable[[], int]) -> None:
        self.model_name, self.running, self.queued = model_name, running, queued

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for name, doc, value in (("sglang:num_running_reqs", "The number of running requests.",
                                  self.running),
                                 ("sglang:num_queue_reqs", "The number of requests in the "
                                  "waiting queue.", self.queued)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value())
            yield family


class EngineMetrics:
    def __init__(self, model_name: str, *, running: Callable[[], int],
                 queued: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Queues(model_name, running, queued))

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(
                model_name)
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens "
                                     "processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation "
                                         "tokens processed.")
        self.requests = counter("sglang:num_requests", "The number of processed requests.")

    def finished(self, results: Iterable[Mapping[str, Any]]) -> None:
        """Count /generate results (SGLang's shape: their meta_info's token counts)."""
        for result in results:
            meta = result.get("meta_info", {})
            self.prompt_tokens.inc(int(meta.get("prompt_tokens", 0)))
            self.generation_tokens.inc(int(meta.get("completion_tokens", 0)))
            self.requests.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
