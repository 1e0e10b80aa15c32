"""Where a run's environment service is (environment.image): the URL the operator gives the
head in a cluster, `kuberl run --environment-url`, or else `python -m kuberl_env` started
here as a local subprocess on a free port, waited on until /health answers and stopped when
the run ends. Every way is checked before anything else starts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kuberl_api import runtime
from kuberl_api.spec import RLJobSpec
from kuberl_trainer.agents.remote import EnvironmentService, EnvironmentUnavailable
from kuberl_trainer.options import Options

STARTUP_TIMEOUT_S = 120.0  # importing the user's module may take a while (its dependencies)
READY_TIMEOUT_S = {True: 600.0, False: 30.0}  # in a cluster: its pods may still be starting
STOP_TIMEOUT_S = 10.0


class LocalEnvironmentServer:
    """`python -m kuberl_env CLASS` on a free port of this machine, its output in `log`."""

    def __init__(self, class_path: str, log: Path) -> None:
        self.class_path, self.log = class_path, log
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kuberl-env-")
        self._port_file = Path(self._dir.name) / "port"

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Start the server and wait until it listens; its URL. EnvironmentUnavailable with
        the end of its output when it exits first (a class that does not import) or is too
        slow."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kuberl_env", self.class_path, "--host", "127.0.0.1",
                 "--port", "0", "--port-file", str(self._port_file), "--exit-with-parent"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._port_file.exists():
            code = self.proc.poll()
            if code is not None:
                raise EnvironmentUnavailable(
                    f"spec.environment.class: the local environment server for "
                    f"{self.class_path} exited with code {code}: {self._tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise EnvironmentUnavailable(
                    f"spec.environment.class: the local environment server for "
                    f"{self.class_path} did not listen within {timeout_s:g} s: {self._tail()}")
            time.sleep(0.05)
        return f"http://127.0.0.1:{int(self._port_file.read_text())}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # the server closes its open episodes, then exits
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()

    def _tail(self, lines: int = 12) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return "(no output)"
        return " | ".join(text) or "(no output)"


@contextlib.contextmanager
def environment_service(spec: RLJobSpec, opts: Options) -> Iterator[EnvironmentService | None]:
    """The run's environment service, ready (None without environment.image)."""
    env = spec.environment
    if env.image is None:
        if opts.environment_url:
            raise EnvironmentUnavailable("--environment-url needs spec.environment.image (with "
                                         "environment.class alone the class runs in process)")
        yield None
        return
    assert env.class_ is not None  # (a rule: image needs class)
    url = opts.environment_url or os.environ.get(runtime.ENV_ENVIRONMENT_URL) or None
    server: LocalEnvironmentServer | None = None
    if url is None and opts.in_cluster:
        raise EnvironmentUnavailable(f"spec.environment.image: ${runtime.ENV_ENVIRONMENT_URL} "
                                     "is not set (the operator sets it on the head)")
    if url is None:
        log = opts.output_dir / "logs" / "environment.log"  # beside the engines' logs
        server = LocalEnvironmentServer(env.class_, log)
    try:
        if server is not None:
            url = server.start()
            print(f"environment: {env.class_} served at {url} (log: {log})", flush=True)
        assert url is not None
        service = EnvironmentService(url, name=env.class_, timeout_s=env.call_timeout_seconds)
        if server is None:
            service.wait_ready(READY_TIMEOUT_S[opts.in_cluster])
        yield service
    finally:
        if server is not None:
            server.stop()
