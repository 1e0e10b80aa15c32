"""A local run's processes end with it however it ends (watchdog.py): real processes, a
stand-in for `kuberl run` that starts its watchdog and then children of every kind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kuberl_trainer import watchdog

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="Linux only")

# The run: its watchdog first, then a child in a session of its own whose parent exits
# (reparented, as Ray's agents are once the raylet dies) and, unless it exits at once ("exit"),
# one that ignores SIGTERM (as a process stuck mid-shutdown may); it prints their PIDs.
RUN = """
import subprocess, sys, time
from kuberl_trainer import watchdog
guard = watchdog.start()
middle = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(120)'], start_new_session=True, stdout=subprocess.DEVNULL); "
    "print(p.pid)"], stdout=subprocess.PIPE, text=True)
children = [int(middle.communicate()[0])]
if sys.argv[1] != "exit":
    stubborn = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(); "
        "time.sleep(120)"], stdout=subprocess.PIPE)
    stubborn.stdout.readline()  # (its handler set)
    children.append(stubborn.pid)
print(guard.pid, *children, flush=True)
if sys.argv[1] != "exit":
    time.sleep(120)
"""


def start_run(how: str) -> tuple[subprocess.Popen[str], int, list[int]]:
    """The run, its watchdog's PID and its children's."""
    run = subprocess.Popen([sys.executable, "-c", RUN, how], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.stdout is not None
    guard, *children = (int(p) for p in run.stdout.readline().split())
    return run, guard, children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # (a zombie has ended; its parent, the run, is gone)


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_a_killed_runs_processes_end_with_it_and_no_other() -> None:
    """SIGKILLed: every process it started ends, the one that ignores SIGTERM too (SIGKILL
    after the grace), then the watchdog; another run's process (another mark) stays. The
    watchdog has a session of its own: the terminal's Ctrl-C (to the run's process group)
    never reaches it."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env={**os.environ, watchdog.MARK_ENV: "another-run"})
    run, guard, children = start_run("wait")
    try:
        assert len(children) == 2
        assert os.getsid(guard) == guard != os.getsid(run.pid)
        os.kill(run.pid, signal.SIGKILL)
        assert run.wait(timeout=30) == -signal.SIGKILL
        assert wait_gone([*children, guard], watchdog.GRACE_S + 10) == []
        assert other.poll() is None
    finally:
        for pid in [*children, other.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        other.wait()


def test_a_run_that_exits_leaving_a_process_behind_ends_it() -> None:
    run, guard, children = start_run("exit")
    try:
        assert run.wait(timeout=30) == 0
        assert wait_gone([*children, guard], watchdog.GRACE_S + 10) == []
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
