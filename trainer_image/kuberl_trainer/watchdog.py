"""A local run's processes end with it, even when it is killed (SIGKILL, the OOM killer).

`kuberl run` without --address starts a Ray (GCS, raylet, the raylet's agents, the actors'
workers), the engines' servers and, for environment.image, an environment server. Ray ties
most of them to the run (the GCS and raylet die with it, by PR_SET_PDEATHSIG; workers exit
with their raylet, and take their children with them) but not all: the raylet's two agents
outlive a SIGKILLed run by a minute (each reports the raylet's death to a GCS that is gone,
retrying), holding memory and ports, and a process could be mid-start when the run dies.

So such a run starts a watchdog before anything else: a small process of its own session
(a terminal's Ctrl-C or hang-up never reaches it) that reads a pipe from the run until it
closes, which happens however the run ends, then ends every process that carries the run's
mark: `KUBERL_RUN_ID`, set in the run's environment first, which every process it starts
inherits, Ray's included. SIGTERM first, SIGKILL after `GRACE_S`. After a run that stopped
normally there is nothing left to end.

Linux (it reads /proc/<pid>/environ); elsewhere no watchdog starts and Ray's own reaper is
what there is. A run that joins a Ray (--address, a cluster) starts none: that Ray's processes
are not the run's, and Ray ends the run's actors when their driver dies.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

MARK_ENV = "KUBERL_RUN_ID"
GRACE_S = 3.0


def start() -> subprocess.Popen[bytes] | None:
    """Mark this process's environment with a new run id and start its watchdog (None where
    there is no /proc). Call before the run starts any process."""
    if not Path("/proc/self/environ").exists():
        return None
    os.environ[MARK_ENV] = secrets.token_hex(12)
    # (its stdin: a pipe whose only writer is this process; non-inheritable, so no child of
    # the run keeps it open)
    return subprocess.Popen([sys.executable, "-m", "kuberl_trainer.watchdog"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            start_new_session=True)


def marked(mark: str) -> list[int]:
    """The live processes whose environment carries `mark` (zombies have none)."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def end(mark: str, spare: tuple[int, ...] = (), grace_s: float = GRACE_S,
        give_up_s: float = 30.0) -> list[int]:
    """SIGTERM every process marked `mark` but this one and `spare`, SIGKILL those left after
    `grace_s` (until none is left, or `give_up_s`: a process stuck in the kernel); the PIDs it
    signalled."""
    skip = {os.getpid(), *spare}
    signalled: set[int] = set()
    began = time.monotonic()
    while True:
        left = [pid for pid in marked(mark) if pid not in skip]
        waited = time.monotonic() - began
        if not left or waited > give_up_s:
            return sorted(signalled)
        for pid in left:
            if waited > grace_s or pid not in signalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if waited > grace_s else signal.SIGTERM)
                signalled.add(pid)
        time.sleep(0.1)


def main() -> None:
    mark, run = os.environ.get(MARK_ENV), os.getppid()
    if not mark:
        return
    while os.read(0, 1 << 16):  # until the run's end of the pipe closes
        pass
    end(mark, spare=(run,))  # (the run itself, when it closed the pipe as it finished)


if __name__ == "__main__":
    main()
