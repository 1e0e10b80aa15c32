"""Who is writing a checkpoint's staging directory, and whether that writer is gone.

A save writes into a hidden staging directory (see the package's docstring); one that a
crash or a SIGKILL interrupted stays behind, as large as a checkpoint. The next save (and a
resumed run) deletes such leftovers, but never a save still in progress: in a cluster two
drivers can share the checkpoint volume for a while (a stalled attempt's head still saving in
its grace period while the next attempt starts). So each staging directory holds a WRITER
file naming the process that writes it, and that process renews the file's time while the
save is open (a lease). A staging directory is a leftover when:

- its writer is on this machine (same kernel boot, same PID namespace) and that process is
  gone (its PID absent, or reused by a process that started at another time): at once, which
  is the case of a local `kuberl run` killed and run again;
- otherwise (another pod, another host), its lease is older than ``STALE_AFTER_S``, measured
  on the storage's own clock (a file just written there), so the hosts' clocks need not agree.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

WRITER = "WRITER"
CLOCK_PREFIX = ".clock."  # storage_now's file, there for an instant
RENEW_S = 30.0  # how often an open save renews its lease
STALE_AFTER_S = 600.0  # a lease this old (twenty renewals missed) is a dead writer's


@dataclass(frozen=True)
class Writer:
    """A process, named so that another process can tell whether it still runs."""

    host: str
    boot: str  # the kernel's boot id: a PID means something only within one boot
    pid_ns: str  # and within one PID namespace (each container has its own)
    pid: int
    started: int | None  # its start time (clock ticks since boot): tells a reused PID apart

    @classmethod
    def this_process(cls) -> Writer:
        return cls(host=socket.gethostname(), boot=_read("/proc/sys/kernel/random/boot_id"),
                   pid_ns=_readlink("/proc/self/ns/pid"), pid=os.getpid(),
                   started=_start_ticks(os.getpid()))

    def same_machine(self, other: Writer) -> bool:
        """Whether `other`'s PID can be looked up from here."""
        return (self.host, self.boot, self.pid_ns) == (other.host, other.boot, other.pid_ns)

    def alive(self) -> bool:
        """Whether this process still runs (asked on its own machine)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: it exists
            pass
        return self.started is None or _start_ticks(self.pid) in (self.started, None)


class Lease:
    """This process's claim on a staging directory: the WRITER file, renewed every `renew_s`
    seconds from a thread until `release`."""

    def __init__(self, staging: Path, renew_s: float = RENEW_S) -> None:
        self.path = staging / WRITER
        self.path.write_text(json.dumps(asdict(Writer.this_process()), sort_keys=True) + "\n")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, args=(renew_s,), daemon=True,
                                        name=f"lease {staging.name}")
        self._thread.start()

    def _renew(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                os.utime(self.path)
            except OSError:  # (the directory was committed or removed meanwhile)
                return

    def release(self) -> None:
        self._stop.set()
        self._thread.join()


def abandoned(staging: Path, *, me: Writer | None = None, now: float | None = None,
              stale_after_s: float = STALE_AFTER_S) -> bool:
    """Whether `staging` is a leftover no process will finish (see the module's docstring).
    `now`: the storage's clock (storage_now), read once by a caller that asks of many."""
    me = me or Writer.this_process()
    writer = _read_writer(staging / WRITER)
    if writer is not None and writer.same_machine(me):
        # This process saves one checkpoint at a time and asks before it begins the next: a
        # directory of its own here is one it gave up (a save that raised).
        return writer.pid == me.pid or not writer.alive()
    try:  # no WRITER (a save killed before writing it) or a writer elsewhere: its lease
        renewed = max(p.stat().st_mtime for p in (staging, staging / WRITER) if p.exists())
    except (OSError, ValueError):
        return False  # (gone meanwhile)
    return (storage_now(staging.parent) if now is None else now) - renewed > stale_after_s


def storage_now(dir: Path) -> float:
    """The time on the clock of the filesystem holding `dir` (an NFS server's, say): the
    modification time of a file written there now."""
    fd, name = tempfile.mkstemp(prefix=CLOCK_PREFIX, dir=dir)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        Path(name).unlink(missing_ok=True)  # (a kill before this: clear_leftovers's)


def _read_writer(path: Path) -> Writer | None:
    try:
        raw = json.loads(path.read_text())
        return Writer(host=str(raw["host"]), boot=str(raw["boot"]), pid_ns=str(raw["pid_ns"]),
                      pid=int(raw["pid"]),
                      started=None if raw.get("started") is None else int(raw["started"]))
    except (OSError, ValueError, KeyError, TypeError):  # absent, or cut short by the kill
        return None


def _start_ticks(pid: int) -> int | None:
    try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces; field 22
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
