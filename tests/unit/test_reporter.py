"""The trainer's heartbeat: a merge patch of status.progress on its own RLJob, with its token."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from kuberl_api.status import Progress
from kuberl_trainer.reporter import StatusReporter


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
    assert progress.last_checkpoint is not None and progress.last_checkpoint.step == 5
    assert progress.last_heartbeat_time and progress.last_heartbeat_time.endswith("Z")
