"""Stopping a job so that it can resume: the preStop hooks (`kuberl graceful-stop`) and the
driver's SIGTERM handling, on real processes, signals and HTTP."""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kuberl_cli.graceful_stop import hold_worker, stop_head
from kuberl_cli.main import main
from kuberl_trainer.stopping import GracefulStop, PidFile, StopRequested

# A driver that saves for a second when told to stop, then exits with SIGTERM's status.
DRIVER = """
import signal, sys, time
def stop(*_):
    time.sleep(1.0)
    open(sys.argv[1], "w").write("saved")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""


def _driver(tmp_path: Path, code: str = DRIVER) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "saved")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    (tmp_path / "driver.pid").write_text(f"{proc.pid}\n")
    return proc


def test_head_hook_waits_while_the_driver_saves(tmp_path: Path) -> None:
    proc = _driver(tmp_path)
    started = time.monotonic()
    assert stop_head(30, tmp_path / "driver.pid") == 0
    assert time.monotonic() - started >= 0.9  # it waited for the save
    assert (tmp_path / "saved").read_text() == "saved"
    assert proc.wait(5) == 143


def test_head_hook_gives_up_at_the_end_of_the_grace_period(tmp_path: Path) -> None:
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
               "print('ready', flush=True)\ntime.sleep(60)\n"
    proc = _driver(tmp_path, stubborn)
    try:
        started = time.monotonic()
        assert stop_head(1.0, tmp_path / "driver.pid") == 0
        assert 0.9 <= time.monotonic() - started < 5
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_head_hook_without_a_driver_returns_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    assert stop_head(30, tmp_path / "missing.pid") == 0
    assert time.monotonic() - started < 1


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"kuberl_step 3\n")

    def log_message(self, *args: object) -> None:
        pass


def test_worker_hook_holds_the_pod_until_the_driver_port_closes() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Timer(1.5, lambda: (server.shutdown(), server.server_close())).start()
    started = time.monotonic()
    assert hold_worker(30, host="127.0.0.1", port=port) == 0
    assert 1.4 <= time.monotonic() - started < 10


def test_worker_hook_without_a_driver_returns_soon() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens
    started = time.monotonic()
    assert hold_worker(30, host="127.0.0.1", port=port) == 0
    assert time.monotonic() - started < 5


def test_the_hook_is_a_kuberl_subcommand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _driver(tmp_path)
    from kuberl_cli import graceful_stop  # (its default pid file is bound at import)
    monkeypatch.setattr(graceful_stop, "stop_head",
                        lambda within: stop_head(within, tmp_path / "driver.pid"))
    assert main(["graceful-stop", "head", "--within", "20"]) == 0
    assert proc.wait(5) == 143


# ---- the driver's side

@pytest.fixture
def stop() -> Iterator[GracefulStop]:
    handler = GracefulStop().install()
    yield handler
    handler.uninstall()


def test_first_sigterm_asks_second_one_interrupts(stop: GracefulStop) -> None:
    stop.check()  # nothing asked yet
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(StopRequested):
        stop.check()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # (the handler runs between bytecodes of the main thread)


def test_a_rollout_in_flight_is_abandoned_at_once(stop: GracefulStop) -> None:
    loop = asyncio.new_event_loop()
    try:
        async def rollout() -> str:
            await asyncio.sleep(30)
            return "done"

        loop.call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        with pytest.raises(StopRequested):
            stop.abandonable(loop, rollout())
        assert time.monotonic() - started < 5
        assert stop.requested.is_set()
    finally:
        loop.close()


def test_a_rollout_finishes_when_nobody_asks(stop: GracefulStop) -> None:
    loop = asyncio.new_event_loop()
    try:
        async def rollout() -> str:
            await asyncio.sleep(0.05)
            return "done"

        assert stop.abandonable(loop, rollout()) == "done"
    finally:
        loop.close()


def test_pid_file_names_the_driver_while_it_runs(tmp_path: Path) -> None:
    with PidFile(tmp_path / "driver.pid"):
        assert (tmp_path / "driver.pid").read_text().strip() == str(os.getpid())
    assert not (tmp_path / "driver.pid").exists()
