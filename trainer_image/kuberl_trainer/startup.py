"""Where a run's start-up goes: one line before the first step, so a person waiting on a slow
start (a 70B model's engines loading, a busy Ray cluster) sees which part it is.

    start-up 7.9 s: checks 1.6, ray 1.3, placement 0.1, engines ready 3.4, trainers ready 0.9,
    first weights 0.6

Each phase is the seconds from the end of the one before it to its own end, counted from the
process's start (the interpreter and imports are in the first phase). The parts of a start-up
overlap (the training workers start while the engines load), so a phase holds what was still
left of it when the phase before ended, not all of its own work.
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When this process started (epoch seconds): its age from /proc (the machine's uptime
    less the process's start tick, both to 10 ms; /proc/stat's boot time is whole seconds),
    taken from now. Now itself where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupClock:
    def __init__(self, began: float | None = None) -> None:
        self.began = process_start_time() if began is None else began
        self.last = self.began
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """`phase` ends now."""
        now = time.time()
        self.phases.append((phase, max(0.0, now - self.last)))
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.began

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases)
        return f"start-up {self.total:.1f} s: {parts}"
