"""The trainer's heartbeat: a merge patch of status.progress on its own RLJob, with its token,
through the `kubernetes` client; checked against a real HTTP server (no mock of the client)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from kuberl_api.status import Progress
from kuberl_trainer.report.status import ReportError, StatusReporter
from tests.unit.status_api import patch_recorder


def test_report_patches_only_progress() -> None:
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append({"path": self.path, "auth": self.headers["Authorization"],
                         "type": self.headers["Content-Type"], "body": json.loads(body)})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    reporter = StatusReporter(f"http://127.0.0.1:{server.server_port}", "tok", "team-a", "job")
    reporter.report(step=7, total_steps=100, reward_mean=0.625, checkpoint=(5, "/ckpt/step_5"),
                    engine_restarts=2)
    server.server_close()

    (req,) = seen
    assert req["path"] == "/apis/kuberl.dev/v1alpha1/namespaces/team-a/rljobs/job/status"
    assert req["auth"] == "Bearer tok" and req["type"] == "application/merge-patch+json"
    assert list(req["body"]) == ["status"] and list(req["body"]["status"]) == ["progress"]
    progress = Progress.model_validate(req["body"]["status"]["progress"])  # the API's shape
    assert (progress.step, progress.total_steps, progress.reward_mean) == (7, 100, 0.625)
    assert progress.engine_restarts == 2
    assert progress.trainer_phase == "Training"  # a step's report: start-up is over
    assert progress.last_checkpoint is not None and progress.last_checkpoint.step == 5
    assert progress.last_heartbeat_time and progress.last_heartbeat_time.endswith("Z")


def test_each_eval_sets_latest_scores_stay_in_progress_evals() -> None:
    """Every report that scores a set replaces that set's entry (with its step); the others
    stay, as the list is patched whole."""
    with patch_recorder(requests=3) as (url, seen):
        reporter = StatusReporter(url, "tok", "team-a", "job")
        reporter.report(step=10, total_steps=100, reward_mean=0.5,
                        evals={"a": {"reward": 0.5, "pass@4": 0.75}, "b": {"reward": 0.25}})
        reporter.report(step=11, total_steps=100, reward_mean=0.5)  # no evaluation this step
        reporter.report(step=20, total_steps=100, reward_mean=0.5,
                        evals={"a": {"reward": 0.625}})

    progress = [Progress.model_validate(body["status"]["progress"]) for body in seen]
    assert progress[1].evals == []  # (a merge patch without the key leaves it as it was)
    assert [(e.name, e.step, e.scores) for e in progress[2].evals] == [
        ("a", 20, {"reward": 0.625}), ("b", 10, {"reward": 0.25})]
    assert progress[0].evals[0].scores == {"reward": 0.5, "pass@4": 0.75}


def test_event_names_the_rljob_by_uid_and_posts_a_core_event() -> None:
    """An engine replaced in a cluster: a Warning Event on the RLJob, which `kubectl describe
    rljob` finds by the RLJob's uid (read once with the Role's `get`)."""
    seen: list[tuple[str, str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: dict[str, Any]) -> None:
            self.send_response(201 if self.command == "POST" else 200)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def do_GET(self) -> None:
            seen.append(("GET", self.path, None))
            self.answer({"metadata": {"name": "job", "uid": "u-1"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(("POST", self.path, body))
            self.answer(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reporter = StatusReporter(f"http://127.0.0.1:{server.server_port}", "tok", "team-a",
                                  "job")
        reporter.event("EngineReplaced", "engine at http://a:1 exited with code -9: replaced")
        reporter.event("EngineReplaced", "engine at http://a:2 stopped answering: replaced")
    finally:
        server.shutdown()
        server.server_close()
    assert [(m, p) for m, p, _ in seen] == [
        ("GET", "/apis/kuberl.dev/v1alpha1/namespaces/team-a/rljobs/job"),
        ("POST", "/api/v1/namespaces/team-a/events"),
        ("POST", "/api/v1/namespaces/team-a/events")]  # (the uid read once)
    event = seen[1][2]
    assert event["involvedObject"] == {"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                                       "name": "job", "namespace": "team-a", "uid": "u-1"}
    assert (event["type"], event["reason"]) == ("Warning", "EngineReplaced")
    assert "exited with code -9" in event["message"]
    assert event["metadata"] == {"generateName": "job.", "namespace": "team-a"}


def test_refused_report_is_an_oserror_with_the_status() -> None:
    """Training goes on through a lost heartbeat: the session catches OSError. A report the
    Role refuses (another RLJob's status) is one, with the API server's status code."""

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden",
                               "code": 403, "message": "rljobs/status is forbidden"}).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    reporter = StatusReporter(f"http://127.0.0.1:{server.server_port}", "tok", "team-a", "other")
    try:
        with pytest.raises(ReportError) as refused:
            reporter.report(step=1, total_steps=10, reward_mean=0.0)
    finally:
        server.server_close()
    assert isinstance(refused.value, OSError) and refused.value.code == 403


def test_unreachable_api_server_is_an_oserror() -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reporter = StatusReporter(f"http://127.0.0.1:{port}", "tok", "team-a", "job", timeout=2)
    with pytest.raises(OSError):
        reporter.report(step=1, total_steps=10, reward_mean=None)


def test_a_refusal_patches_only_the_trainers_refusal_of_its_attempt() -> None:
    """`refuse`: status.trainerRefusal in the API's shape, naming the attempt, and nothing the
    operator owns (a merge patch of one key leaves phase and conditions alone); a message past
    the API's bound is cut at its end, so the field it names stays."""
    from kuberl_api.status import MAX_REFUSAL_MESSAGE, RLJobStatus

    typo = "spec.reward: cannot import module 'rewardz' (No module named 'rewardz')"
    with patch_recorder(requests=2) as (url, seen):
        reporter = StatusReporter(url, "tok", "team-a", "job")
        reporter.refuse(3, typo)
        reporter.refuse(4, "spec.algorithm.lossFunction: " + "x" * 2 * MAX_REFUSAL_MESSAGE)
    assert [list(body) for body in seen] == [["status"], ["status"]]
    assert [list(body["status"]) for body in seen] == [["trainerRefusal"], ["trainerRefusal"]]
    first = RLJobStatus.model_validate(seen[0]["status"]).trainer_refusal
    assert first is not None and (first.attempt, first.message) == (3, typo)
    assert first.time.endswith("Z")
    cut = RLJobStatus.model_validate(seen[1]["status"]).trainer_refusal
    assert cut is not None and len(cut.message) == MAX_REFUSAL_MESSAGE
    assert cut.message.startswith("spec.algorithm.lossFunction: ") and cut.message.endswith("...")
