"""The engines' own Prometheus metrics, served on the trainer's endpoint, labelled by engine.

Engines listen on ports chosen when they start (a replacement gets another), several to a pod,
so no PodMonitor can name them. The trainer knows where they are: at each scrape of its
endpoint (the one the chart's PodMonitor already scrapes, `trainer-metrics`) it reads every
engine in rotation's GET /metrics (SGLang's `--enable-metrics`, which kuberl passes; the
reference engine serves the same names) concurrently, with a short timeout, and serves their
samples with an `engine` label (the engine's URL). An engine that does not answer in time is
left out of that scrape; the others are not held up by it.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

SCRAPE_TIMEOUT_S = 2.0
ENGINE_LABEL = "engine"


class EngineMetrics(Collector):
    def __init__(self, urls: Callable[[], list[str]],
                 timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.urls, self.timeout_s = urls, timeout_s

    def collect(self) -> Iterator[Metric]:
        urls = list(self.urls())
        if not urls:
            return
        with ThreadPoolExecutor(len(urls), thread_name_prefix="engine-metrics") as pool:
            texts = list(pool.map(self._read, urls))
        merged: dict[str, Metric] = {}
        for url, text in zip(urls, texts, strict=True):
            if text is None:
                continue
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(
                    family.name, family.documentation, family.type, family.unit))
                for s in family.samples:
                    into.add_sample(s.name, {**s.labels, ENGINE_LABEL: url}, s.value,
                                    s.timestamp, s.exemplar)
        yield from merged.values()

    def _read(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=self.timeout_s) as answer:
                return str(answer.read().decode())
        except (OSError, ValueError):  # (dead, hung, restarting: left out of this scrape)
            return None
