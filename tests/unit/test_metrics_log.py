"""metrics.jsonl and the Prometheus endpoint agree: gauges for per-step numbers, counters for
running totals (`<name>_total` in a step's record)."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

from kuberl_trainer.report.metrics_log import MetricsLog


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {name: float(value) for line in text.splitlines()
            if line.startswith("kuberl_") and len(parts := line.split()) == 2
            for name, value in [parts]}


def test_running_totals_are_counters_and_per_step_numbers_gauges(tmp_path: Path) -> None:
    port = free_port()
    log = MetricsLog(tmp_path, prometheus_port=port)
    try:
        log.write({"step": 0, "reward_mean": 0.25, "engine_restarts_total": 0})
        log.write({"step": 1, "reward_mean": 0.5, "engine_restarts_total": 2})
        seen = scrape(port)
        assert seen["kuberl_engine_restarts_total"] == 2
        assert "kuberl_train_engine_restarts_total" not in seen
        assert seen["kuberl_train_reward_mean"] == 0.5 and seen["kuberl_train_step"] == 1
        log.write({"step": 2, "reward_mean": 0.5, "engine_restarts_total": 2})
        assert scrape(port)["kuberl_engine_restarts_total"] == 2  # counted once
    finally:
        log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["engine_restarts_total"] for r in rows] == [0, 2, 2]


def test_engine_metric_names_keep_their_colons_for_an_openmetrics_scraper() -> None:
    """Prometheus 2.x asks for OpenMetrics first, where prometheus_client escapes SGLang's
    `sglang:` names; the endpoint answers in the text format, which keeps them."""
    import socket
    import urllib.request

    from prometheus_client import CollectorRegistry, Gauge

    from kuberl_trainer.report.metrics_log import serve_text_format

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    registry = CollectorRegistry()
    Gauge("sglang:num_running_reqs", "requests running", registry=registry).set(3)
    server = serve_text_format(port, registry, addr="127.0.0.1")
    try:
        asks = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"})
        with urllib.request.urlopen(asks, timeout=5) as answer:
            body = answer.read().decode()
            assert answer.headers["Content-Type"].startswith("text/plain")
        assert "sglang:num_running_reqs 3.0" in body, body
    finally:
        server.shutdown()
        server.server_close()
