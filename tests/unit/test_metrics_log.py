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


def test_eval_scores_are_gauges_in_the_characters_prometheus_allows(tmp_path: Path) -> None:
    """metrics.jsonl keeps the names a person reads (pass@8, the set's own name); the gauge
    says @ as _at_ and a set name's - as _ (an invalid name would fail the step)."""
    port = free_port()
    log = MetricsLog(tmp_path, prometheus_port=port)
    try:
        log.write({"step": 3, "eval_math-500_pass@8": 0.75, "eval_math-500_reward": 0.5})
        seen = scrape(port)
    finally:
        log.close()
    assert seen["kuberl_train_eval_math_500_pass_at_8"] == 0.75
    assert seen["kuberl_train_eval_math_500_reward"] == 0.5
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["eval_math-500_pass@8"] == 0.75


def test_mode_eval_appends_and_keeps_the_training_runs_rows(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    for step in (0, 1):
        log.write({"step": step})
    log.close()
    log = MetricsLog(tmp_path, first_step=None)  # (a training run from step 0 would drop both)
    log.write({"step": 2, "eval_a_reward": 1.0})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


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


def test_a_run_starting_at_step_k_moves_the_rows_of_step_k_and_later_aside(
        tmp_path: Path) -> None:
    """A run killed after its last checkpoint (step 2) had written rows 2 and 3, the last cut
    short by the kill: the run resumed there trains them again, so they move to
    metrics.dropped.jsonl and metrics.jsonl keeps one row per step."""
    rows = [json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(rows)[:-9])  # the last row cut short
    log = MetricsLog(tmp_path, first_step=2)
    try:
        assert log.dropped == 2
        log.write({"step": 2, "reward_mean": 0.25})
    finally:
        log.close()
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward_mean"]) for r in kept] == [(0, 0.0), (1, 0.1), (2, 0.25)]
    assert (tmp_path / "metrics.dropped.jsonl").read_text() == rows[2] + rows[3][:-9] + "\n"
    # A run with nothing to drop leaves both files as they are; no file, nothing to do.
    for first, out in ((3, tmp_path), (0, tmp_path / "new")):
        log = MetricsLog(out, first_step=first)
        log.close()
        assert log.dropped == 0
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
