"""A real Prometheus (Debian's package, unpacked by e2e/build.sh) for the e2e tests.

It scrapes static targets every second, so a test can ask, through the same HTTP API Grafana
and alerting rules use, what a user's dashboard would show (and load rule files, whose alerts
`rules()` reports)::

    with Prometheus.start(tmp_path, {"kuberl-operator": ["127.0.0.1:9090"]}) as prom:
        prom.wait_target_up("kuberl-operator")
        prom.query('kuberl_rljob_status_phase{phase="Running"} == 1')

The config is checked with promtool first, so a bad config fails with promtool's message
instead of a Prometheus that never becomes ready.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from cluster import binaries, terminate
from polling import wait_for

SCRAPE_INTERVAL = "1s"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape_config(jobs: Mapping[str, Sequence[str]],
                  labels: Mapping[str, Mapping[str, str]] | None = None,
                  rule_files: Sequence[Path] = ()) -> dict[str, Any]:
    """`labels`: per job, target labels (what a PodMonitor's relabelling would attach, e.g.
    namespace and rljob); `rule_files`: alerting/recording rules Prometheus evaluates (every
    SCRAPE_INTERVAL, like the scrapes)."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [{"job_name": job, "static_configs": [
            {"targets": list(targets), **({"labels": dict(labels[job])}
                                          if labels and job in labels else {})}]}
            for job, targets in jobs.items()],
    }
    if rule_files:
        config["rule_files"] = [str(f) for f in rule_files]
    return config


def promtool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Debian's promtool of the e2e cache (e2e/build.sh), e.g. `promtool("test", "rules", f)`."""
    return subprocess.run([str(binaries().dirs["prometheus"] / "promtool"), *args],
                          capture_output=True, text=True, timeout=timeout)


class Prometheus:
    def __init__(self, workdir: Path, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.workdir, self.port, self.proc = workdir, port, proc
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, workdir: Path, jobs: Mapping[str, Sequence[str]],
              labels: Mapping[str, Mapping[str, str]] | None = None,
              rule_files: Sequence[Path] = ()) -> Prometheus:
        bin_dir = binaries().dirs["prometheus"]
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(jobs, labels, rule_files),
                                         sort_keys=False))
        # (checks the rule files too)
        check = promtool("check", "config", str(config), timeout=60)
        if check.returncode != 0:
            raise RuntimeError(f"promtool refused {config}: {check.stdout}{check.stderr}")
        port = _free_port()
        log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(
            [str(bin_dir / "prometheus"), f"--config.file={config}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--web.enable-lifecycle"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        log.close()
        prom = cls(workdir, port, proc)
        try:
            wait_for("Prometheus /-/ready", prom._ready, timeout=60, detail=prom.tail)
        except BaseException:
            prom.stop()
            raise
        return prom

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                ok: bool = resp.status == 200
                return ok
        except OSError:
            return False

    def tail(self, lines: int = 30) -> str:
        log = self.workdir / "prometheus.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return "----- prometheus log (end) -----\n" + "\n".join(text.splitlines()[-lines:])

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus {path}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": {labels}, "value": [time, "1"]}, ...]."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its state: health ("ok" | "err" | "unknown"), lastError,
        and for an alert its active alerts (labels, state "pending" | "firing")."""
        groups: list[dict[str, Any]] = self.api("rules")["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def targets(self, job: str) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return [t for t in active if t.get("labels", {}).get("job") == job]

    def wait_target_up(self, job: str, timeout: float = 30) -> None:
        wait_for(f"Prometheus target {job} up", lambda: any(
            t.get("health") == "up" for t in self.targets(job)), timeout=timeout,
            detail=lambda: json.dumps(self.targets(job), indent=1) + "\n" + self.tail())

    def stop(self) -> None:
        terminate(self.proc)
