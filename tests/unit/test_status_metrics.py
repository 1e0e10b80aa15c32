"""The status gauges (kube-state-metrics style) and the operator's flags/env parsing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kuberl_operator.metrics import Metrics
from kuberl_operator.settings import Config, kopf_settings, parse_args


def _text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_phase_and_condition_gauges_then_forget() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    m.observe_status("ns", "a", {"phase": "Running", "conditions": [
        {"type": "Training", "status": "True"}, {"type": "Stalled", "status": "False"}]})
    text = _text(reg)
    assert 'kuberl_rljob_status_phase{name="a",namespace="ns",phase="Running"} 1.0' in text
    assert 'kuberl_rljob_status_phase{name="a",namespace="ns",phase="Pending"} 0.0' in text
    assert ('kuberl_rljob_condition{name="a",namespace="ns",status="True",type="Training"} 1.0'
            in text)
    assert ('kuberl_rljob_condition{name="a",namespace="ns",status="False",type="Training"} 0.0'
            in text)
    m.observe_status("ns", "a", {"phase": "Succeeded", "conditions": []})
    assert 'phase="Running"} 0.0' in _text(reg)
    m.forget("ns", "a")
    m.forget("ns", "a")  # idempotent
    assert 'name="a"' not in _text(reg)
    assert 'kuberl_operator_reconcile_total{result="error"} 0.0' in _text(reg)


def test_progress_gauges_follow_the_trainers_report_then_forget() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    m.observe_status("ns", "a", {"phase": "Pending", "conditions": [], "restarts": 0})
    text = _text(reg)
    assert 'kuberl_rljob_restarts{name="a",namespace="ns"} 0.0' in text
    assert 'kuberl_rljob_progress_step{name="a"' not in text  # nothing reported yet
    m.observe_status("ns", "a", {"phase": "Running", "conditions": [], "restarts": 1}, {
        "step": 41, "rewardMean": 0.53125, "lastHeartbeatTime": "2026-03-01T12:00:00Z",
        "lastCheckpoint": {"step": 40, "path": "/c/40"}})
    text = _text(reg)
    assert 'kuberl_rljob_progress_step{name="a",namespace="ns"} 41.0' in text
    assert 'kuberl_rljob_progress_reward_mean{name="a",namespace="ns"} 0.53125' in text
    assert 'kuberl_rljob_last_checkpoint_step{name="a",namespace="ns"} 40.0' in text
    assert 'kuberl_rljob_restarts{name="a",namespace="ns"} 1.0' in text
    assert ('kuberl_rljob_last_heartbeat_timestamp_seconds{name="a",namespace="ns"} '
            '1.7723664e+09') in text  # 2026-03-01T12:00:00Z
    m.forget("ns", "a")
    assert 'name="a"' not in _text(reg)


def test_flags_override_env_and_defaults() -> None:
    env = {"KUBERL_METRICS_PORT": "9000", "KUBERL_NAMESPACES": "a,b",
           "KUBERL_RESYNC_SECONDS": "7", "KUBERL_SCANNING": "false"}
    c = parse_args([], env)
    assert (c.metrics_port, c.namespaces, c.resync_seconds, c.scanning) == (9000, ("a", "b"),
                                                                            7.0, False)
    c = parse_args(["--metrics-port", "0", "-n", "x", "--head-lost-grace-seconds", "3"], env)
    assert (c.metrics_port, c.namespaces) == (0, ("x",))
    assert c.tunables.head_lost_grace.total_seconds() == 3
    assert parse_args([], {}) == Config()
    assert Config(health_port=0).liveness_endpoint is None
    assert kopf_settings(Config(scanning=False)).scanning.disabled


def test_eval_score_gauges_follow_progress_evals_then_forget() -> None:
    """Each eval set's latest scores, as the trainer put them in progress.evals (a job of mode
    eval ends with them here); a set or metric the status no longer has leaves."""
    reg = CollectorRegistry()
    m = Metrics(reg)
    evals = [{"name": "gsm8k", "step": 40, "scores": {"reward": 0.5, "pass@8": 0.875}},
             {"name": "math-500", "step": 40, "scores": {"maj@4": 0.25}}]
    m.observe_status("ns", "a", {"phase": "Running"}, {"step": 40, "evals": evals})
    text = _text(reg)
    assert ('kuberl_rljob_eval_score{metric="pass@8",name="a",namespace="ns",set="gsm8k"} '
            '0.875') in text
    assert ('kuberl_rljob_eval_score{metric="maj@4",name="a",namespace="ns",set="math-500"} '
            '0.25') in text
    assert 'kuberl_rljob_eval_step{name="a",namespace="ns",set="gsm8k"} 40.0' in text
    m.observe_status("ns", "a", {"phase": "Running"},
                     {"step": 50, "evals": [{"name": "gsm8k", "step": 50,
                                             "scores": {"reward": 0.625}}]})
    text = _text(reg)
    assert 'kuberl_rljob_eval_score{metric="reward",name="a",namespace="ns",set="gsm8k"} 0.625' \
        in text
    assert 'metric="pass@8"' not in text and 'set="math-500"' not in text
    m.forget("ns", "a")
    assert "kuberl_rljob_eval" not in _text(reg).replace("# HELP kuberl_rljob_eval", "").replace(
        "# TYPE kuberl_rljob_eval", "")
