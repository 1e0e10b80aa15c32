"""What a component's start function is handed: the cluster it joins, the binaries, the time
left, and how to spawn and wait for a process."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .versions import Binaries

if TYPE_CHECKING:
    from .cluster import Cluster


@dataclass
class Boot:
    cluster: Cluster
    bins: Binaries
    deadline: float
    die_with_parent: bool
    say: Callable[[str], None]
    t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def bin(self, name: str) -> str:
        return str(self.bins.path(name))

    def spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> None:
        self.cluster._spawn(name, argv, self.die_with_parent, env)

    def wait_for(self, name: str, what: str, ok: Callable[[], Any]) -> None:
        self.cluster._wait_for(name, what, self.left(), ok)

    def apply(self, *files: Path) -> None:
        """kubectl apply --server-side of files (Paths) as admin."""
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts",
                             *[f"--filename={f}" for f in files], timeout=self.left())

    def mark(self, stage: str) -> None:
        """Record how long the stage since the last mark took (Cluster.timings, the log)."""
        now = time.monotonic()
        self.cluster.timings[stage] = round(now - self.t0, 2)
        self.say(f"{stage}: {now - self.t0:.1f}s")
        self.t0 = now
