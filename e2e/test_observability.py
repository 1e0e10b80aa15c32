"""The chart's observability pack against real data: the Grafana dashboard
(helm/kuberl/dashboards/kuberl.json) and the alert rules (helm/kuberl/rules/kuberl-alerts.yaml).

- `promtool test rules` (Debian's promtool from e2e/build.sh's cache) runs the alerts' unit
  tests on recorded series (e2e/promtool/kuberl-alerts.test.yaml): each alert fires when it
  should, with its labels and annotations, and not when it should not; and those tests fail for
  alerts that never fire (so they test something).
- A real Prometheus scrapes the real operator (reconciling a real RLJob on the e2e control
  plane, to which the trainer reports a heartbeat after each step through its real
  `StatusReporter`) and a real trainer-metrics endpoint: the trainer's own exporter
  (`MetricsLog` with `prometheus_port`, the engines' metrics through `EngineMetrics` from a
  reference engine's /metrics), fed step records built by the trainer's own metric functions,
  labelled as the chart's PodMonitor labels a Ray head's series (namespace, rljob). Every
  PromQL expression of the dashboard (template variables substituted as Grafana does) must
  return data; every expression of the rule file must evaluate, every selector in it must
  select series, and with its comparisons made `bool` it must return data (the operator's and
  the trainer's labels join). Prometheus loads the rule file too: every rule evaluates
  without error, the engine restarts the trainer recorded fire KuberlEngineRestartsClimbing,
  and a second RLJob that really fails (backoffLimit 0, KubeRay failing its RayJob) fires
  KuberlRLJobFailed.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cluster import Cluster
from polling import wait_for
from prometheus import Prometheus, promtool
from promql import Query, as_bool, dashboard_queries, rule_queries, selectors, substitute
from rljobs import JobWatch, Operator, cpu_job, free_port, kubectl_apply, unique
from stand_in import head_reporter

from kuberl_rollout.reference.metrics import CONTENT_TYPE, EngineMetrics as ReferenceMetrics
from kuberl_trainer.algos.objective import Objective
from kuberl_trainer.backends.step_metrics import StepMetrics
from kuberl_trainer.engines.metrics import EngineMetrics
from kuberl_trainer.loops.staleness import overlap_times, staleness_metrics
from kuberl_trainer.report.metrics_log import MetricsLog
from kuberl_trainer.report.status import StatusReporter
from kuberl_trainer.rollout.batch import engine_throughput
from kuberl_trainer.rollout.generate import Response
from kuberl_trainer.rollout.grading import Grades, RewardTally
from kuberl_trainer.rollout.prompts import Sample

pytestmark = pytest.mark.e2e

E2E = Path(__file__).resolve().parent
CHART = E2E.parent / "helm" / "kuberl"
DASHBOARD = CHART / "dashboards" / "kuberl.json"
RULES = CHART / "rules" / "kuberl-alerts.yaml"
RULE_TESTS = E2E / "promtool" / "kuberl-alerts.test.yaml"
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval (4 scrapes at least; these are 1 s apart)
ENGINE_RESTARTS = 3  # what the trainer records: KuberlEngineRestartsClimbing's default
SYNC_BYTES = 1_320_000  # one weight sync: the tiny demo model's 0.66M parameters in bf16
TOTAL_STEPS = 1000  # what the trainer reports as the run's length


# --------------------------------------------------------------------------- promtool


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    check = promtool("check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_promtool_unit_tests_fail_for_alerts_that_never_fire(tmp_path: Path) -> None:
    """The unit tests are not vacuous: with every alert's expression replaced by one that
    never fires, each alert's expected firing fails."""
    rules = yaml.safe_load(RULES.read_text())
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["expr"] = "vector(1) == 0"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = ["rules.yaml"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    done = promtool("test", "rules", str(tmp_path / "tests.yaml"))
    report = done.stdout + done.stderr
    assert done.returncode != 0, report
    for alert in alerts:
        assert f"alertname: {alert}," in report, (alert, report)


# ----------------------------------------------------------------- a trainer's endpoint


class EngineStandIn:
    """A reference engine's GET /metrics (its real EngineMetrics), without the model: the
    trainer's EngineMetrics collector reads it at each scrape, as it reads a live engine."""

    def __init__(self) -> None:
        self.metrics = ReferenceMetrics("/models/tiny", running=lambda: 3, queued=lambda: 1)
        exposition = self.metrics.exposition

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exposition()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, n: int) -> None:
        self.metrics.finished([{"meta_info": {"prompt_tokens": 40, "completion_tokens": 64}}
                               for _ in range(n)])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def step_record(step: int, engine: str) -> dict[str, Any]:
    """One async step's record as the loop writes it (async_loop.py), its parts from the
    trainer's own functions where they are pure: the objective's statistics (the
    train-inference gap's too) through the backend's StepMetrics, the rollout's engine
    throughput, staleness and overlap; the rollout's reward statistics as
    RolloutManager._metrics names them; the weight-sync bytes as loop.sync_bytes names them
    (each step's sync, and the total with the start-up sync's)."""
    stats = StepMetrics()
    # the objective's own statistics of a micro-batch: engines 0.006 nats per token off the
    # trainer (bfloat16's usual train-inference gap: KuberlTrainInferenceGapHigh stays quiet)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    _, objective_stats = Objective().partial_loss(logp, logp, mask, mask, entropy=mask,
                                                  rollout_logp=logp - 0.006 * mask)
    stats.add_micro(tokens=mask.sum(), loss=torch.tensor(0.25), stats=objective_stats)
    stats.add_step(1.5, 1e-6)
    sample = Sample("1+1?", "2", 0, 0)
    responses = [Response(sample, [1, 2], list(range(64)), [0.0] * 64, "2", False,
                          weight_version=str(step), engine=engine, seconds=0.5 + 0.1 * i,
                          request=i) for i in range(4)]
    rollout = {"reward_mean": 0.1 * step, "reward_std": 0.2, "score_mean": 0.1 * step,
               "response_length_mean": 64.0, "truncated_fraction": 0.0,
               **engine_throughput(responses)}
    # a reward called over HTTP (reward.type remote or model): a retry, and on odd steps one
    # sample of 4 (groups of 2) without a reward
    tally = RewardTally(remote=True)
    tally.add(Grades([1.0, 0.0, 1.0, None if step % 2 else 0.0],
                     [None, None, None, "HTTP 500" if step % 2 else None], [{}] * 4,
                     seconds=0.2, retries=1), n=2)
    rollout |= tally.metrics()
    return {"step": step, **rollout, **stats.summary(), "weight_version": step + 1,
            **staleness_metrics(step, [(str(step - 1), str(step - 1))], step - 1),
            "time_generate_s": 2.0, "engine_restarts_total": min(step, ENGINE_RESTARTS),
            "run_ahead_depth": 1,
            "weight_sync_bytes": SYNC_BYTES, "weight_sync_bytes_total": SYNC_BYTES * (step + 2),
            **overlap_times(train_s=1.5, sync_s=0.3, step_s=2.2, trainers_idle_s=0.4,
                            engines_idle_s=0.1, generating_s=2.0),
            "eval_gsm8k_reward": 0.5}


class Trainer:
    """The trainer's metrics endpoint, recording a step a second from `start` until stopped,
    and after each step reporting it to the RLJob status (the heartbeat) as the trainer's
    session does (session._Watchers)."""

    def __init__(self, out_dir: Path, reporter: StatusReporter) -> None:
        self.engine = EngineStandIn()
        self.port = free_port()
        self.log = MetricsLog(out_dir, prometheus_port=self.port)
        self.log.serve_also(EngineMetrics(lambda: [self.engine.url]))
        self.reporter = reporter
        self.report_errors: list[str] = []
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.engine.generate(4)
            record = step_record(self.steps, self.engine.url)
            self.log.write(record)
            try:
                self.reporter.report(step=self.steps + 1, total_steps=TOTAL_STEPS,
                                     reward_mean=record["reward_mean"],
                                     engine_restarts=record["engine_restarts_total"])
            except OSError as exc:  # (the session logs it and trains on)
                self.report_errors.append(str(exc))
            self.steps += 1
            self._stop.wait(1.0)

    def start(self) -> None:
        self._thread.start()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        # (MetricsLog's prometheus_client server thread has no stop: a daemon, it ends with
        # the session; nothing records on it any more)
        self._stop.set()
        self._thread.join(timeout=10)
        self.log.close()
        self.engine.stop()


# ------------------------------------------------------------------ against real data


@dataclass(frozen=True)
class Observed:
    prom: Prometheus
    ns: str
    job: str  # reconciled by the operator, with a trainer endpoint
    failing: str  # reconciled by the operator; fails (below)


@pytest.fixture(scope="module")
def observed(k8s_cluster: Cluster, operator: Operator, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Observed]:
    """A real RLJob reconciled by the real operator and the trainer endpoint of that job, both
    scraped every second, the rule file loaded; and a second RLJob with backoffLimit 0 that
    fails for real: KubeRay fails its RayJob ~30 s after the submitter (kwok) finished without a
    reachable Ray dashboard (e2e/README.md), and the operator fails the RLJob."""
    ns, job, failing = operator.ns, unique("obs"), unique("obs-fail")
    kubectl_apply(k8s_cluster, cpu_job(job, ns), check=True)
    kubectl_apply(k8s_cluster, cpu_job(failing, ns, backoffLimit=0), check=True)
    watch = JobWatch(k8s_cluster, operator, ns, job)
    wait_for(f"RLJob {job} has a phase", lambda: watch.status().get("phase"), timeout=60,
             detail=watch.detail)
    workdir = tmp_path_factory.mktemp("observability")
    rules = workdir / "kuberl-alerts.yaml"
    shutil.copy(RULES, rules)
    reporter = head_reporter(k8s_cluster, ns, job)  # (the head's ServiceAccount)
    try:
        with Trainer(workdir / "trainer", reporter) as trainer, Prometheus.start(
                workdir / "prometheus",
                {"kuberl-operator": [f"127.0.0.1:{operator.metrics_port}"],
                 "kuberl-trainer": [f"127.0.0.1:{trainer.port}"]},
                # what the chart's PodMonitor attaches to a Ray head's series
                labels={"kuberl-trainer": {"namespace": ns, "rljob": job,
                                           "pod": f"{job}-r0-head", "attempt": "0"}},
                rule_files=[rules]) as prom:
            prom.wait_target_up("kuberl-operator")
            prom.wait_target_up("kuberl-trainer")
            trainer.start()  # (scraped from its first step: increase() sees every restart)
            # Enough scrapes for rate() and changes(), and the restarts recorded.
            wait_for("the trainer's engine restarts in Prometheus", lambda: prom.query(
                f'kuberl_engine_restarts_total{{rljob="{job}"}} >= {ENGINE_RESTARTS}'),
                timeout=60, detail=prom.tail)
            wait_for("4 scrapes of the trainer", lambda: prom.query(
                f'count_over_time(kuberl_train_step{{rljob="{job}"}}[1m]) >= 4'),
                timeout=30, detail=prom.tail)
            wait_for("the trainer's heartbeat on the operator's endpoint", lambda: prom.query(
                f'kuberl_rljob_last_heartbeat_timestamp_seconds{{name="{job}"}}'),
                timeout=30, detail=lambda: f"{trainer.report_errors[-3:]}\n{prom.tail()}")
            yield Observed(prom, ns, job, failing)
    finally:
        for name in (job, failing):
            k8s_cluster.kubectl("delete", "rljob", name, "-n", ns, "--wait=false", check=False)


def dashboard_variables(ns: str, job: str) -> dict[str, str]:
    return {"namespace": ns, "rljob": job, "__rate_interval": RATE_INTERVAL,
            "__interval": "1s", "__range": "5m", "datasource": "prometheus"}


def failures(queries: list[Query], check: Callable[[Query], str | None]) -> list[str]:
    out = []
    for q in queries:
        try:
            problem = check(q)
        except Exception as exc:  # a refused query: Prometheus' error names the problem
            problem = f"refused: {exc}"
        if problem:
            out.append(f"{q.where}: {problem}\n    {q.expr}")
    return out


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    prom, ns, job = observed.prom, observed.ns, observed.job
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= 30, [q.where for q in queries]
    variables = dashboard_variables(ns, job)

    def returns_data(q: Query) -> str | None:
        expr = substitute(q.expr, variables)
        if not prom.query(expr):
            empty = [s for s in selectors(expr) if not prom.query(s)]
            return f"no data (selectors without series: {empty})"
        return None

    assert not failures(queries, returns_data), "\n".join(failures(queries, returns_data))


def test_every_alert_expression_evaluates_on_real_series(
        observed: Observed) -> None:
    prom = observed.prom
    queries = rule_queries(RULES)

    def evaluates(q: Query) -> str | None:
        prom.query(q.expr)  # parses and evaluates (the condition may well be false)
        empty = [s for s in selectors(q.expr) if not prom.query(s)]
        if empty:
            return f"selectors without series: {empty}"
        if not prom.query(as_bool(q.expr)):
            return f"no data with its comparisons made bool: {as_bool(q.expr)}"
        return None

    problems = failures(queries, evaluates)
    assert not problems, "\n".join(problems)


def test_prometheus_evaluates_the_rules_and_fires_on_engine_restarts(
        observed: Observed) -> None:
    prom, ns, job = observed.prom, observed.ns, observed.job
    expected = {q.where.removeprefix("alert ") for q in rule_queries(RULES)}

    def evaluated() -> list[dict[str, Any]] | None:
        rules = prom.rules()
        return rules if rules and all(r.get("health") == "ok" for r in rules) else None

    rules = wait_for("every rule evaluated without error", evaluated, timeout=30,
                     detail=lambda: json.dumps(prom.rules(), indent=1))
    assert {r["name"] for r in rules} == expected

    def firing() -> list[dict[str, Any]]:
        rule = next(r for r in prom.rules() if r["name"] == "KuberlEngineRestartsClimbing")
        return [a for a in rule.get("alerts", []) if a["state"] == "firing"]

    alerts = wait_for("KuberlEngineRestartsClimbing firing", firing, timeout=30,
                      detail=lambda: json.dumps(prom.rules(), indent=1))
    assert [(a["labels"]["namespace"], a["labels"]["rljob"], a["labels"]["severity"])
            for a in alerts] == [(ns, job, "warning")], alerts
    # increase() extrapolates a counter's few samples to the window's edges: at least the
    # restarts recorded (the exact number depends on when the samples fell).
    summary = alerts[0]["annotations"]["summary"]
    said = re.fullmatch(rf"RLJob {ns}/{job} replaced (\d+) engines in the last hour\.", summary)
    assert said is not None and int(said.group(1)) >= ENGINE_RESTARTS, summary
    # Nothing else fires for a job that is a minute old (the failing one aside).
    others = [(r["name"], a["labels"]) for r in prom.rules() if r["name"] not in (
        "KuberlEngineRestartsClimbing",) for a in r.get("alerts", [])
        if a["state"] == "firing" and a["labels"].get("name") != observed.failing]
    assert not others, others


@pytest.mark.kuberay
def test_a_job_that_fails_fires_kuberl_rljob_failed(observed: Observed) -> None:
    """The real operator's phase series of a job that really failed fire the alert."""
    prom, ns = observed.prom, observed.ns

    def firing() -> list[dict[str, Any]]:
        rule = next(r for r in prom.rules() if r["name"] == "KuberlRLJobFailed")
        return [a for a in rule.get("alerts", []) if a["state"] == "firing"]

    alerts = wait_for(f"KuberlRLJobFailed firing for {observed.failing}", firing, timeout=150,
                      detail=lambda: json.dumps(prom.query(
                          f'kuberl_rljob_status_phase{{name="{observed.failing}"}} == 1'))
                      + "\n" + prom.tail())
    assert [(a["labels"]["namespace"], a["labels"]["name"]) for a in alerts] == [
        (ns, observed.failing)], alerts
    assert alerts[0]["annotations"]["summary"] == f"RLJob {ns}/{observed.failing} failed."
