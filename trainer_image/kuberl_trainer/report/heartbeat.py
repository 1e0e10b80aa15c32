"""The trainer's heartbeat during start-up: the phase it is in, reported every few seconds.

After the first step the heartbeat is the per-step report (session._Watchers): a step that
finishes is the proof of life. Before it there is no step, and placement, the engines' start,
a large model's load and the first step can each take longer than heartbeatTimeoutSeconds
(900 s by default), so the operator would restart a healthy slow job as Stalled. So from the
moment the trainer starts, a thread reports the phase it is in (`progress.trainerPhase`) every
`interval_s`, until the first step's report takes over.

What "alive" means here. A thread beating on its own would hide a start-up that hangs (a
deadlock, a mount that never answers): the process lives, its heartbeat never stops. So each
phase beats only for its own limit (`PHASE_LIMITS_S`): the time its own timeout allows
(placement, the engines' start) or a generous bound for phases without one (the models'
load, the first step). A phase that outlives its limit goes silent, and the operator's
heartbeatTimeoutSeconds catches it as it catches a hung step. A dead process beats no more
(the thread is a daemon of the trainer's process), so a crashed trainer is caught as before.

Rejected: beating for the whole run (a hung step would never be Stalled), and raising
heartbeatTimeoutSeconds for start-up (a job that dies while loading would wait that long).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kuberl_api.status import TrainerPhase
from kuberl_trainer.ray_actors import PLACEMENT_TIMEOUT_S

LOG = logging.getLogger("kuberl.run")

# The engines' own start timeout (session.ENGINE_START_TIMEOUT_S; the same number, kept here
# so this module imports neither torch nor the session).
ENGINE_START_S = 600.0
# A phase's beats stop this long after it began (a minute's margin past its own timeout).
PHASE_LIMITS_S: dict[str, float] = {
    "Starting": 600.0,                    # Ray joined, the engines' actors created
    "Placing": PLACEMENT_TIMEOUT_S + 60,  # the training ranks' placement group
    "EnginesStarting": ENGINE_START_S + 60,
    "Loading": 7200.0,                    # models built and loaded (a 70B from slow storage)
    "FirstStep": 3600.0,                  # the first weights, rollout and update
    "Evaluating": 7200.0,                 # mode eval: the eval sets, sampled and graded
}
INTERVAL_S = 30.0


class StartupHeartbeat:
    """Calls `send(phase)` now and every `interval_s` while the current phase is within its
    limit; `stop` ends it (the first step reported, or the run ending). Errors of `send` are
    logged, never raised: a lost heartbeat must not stop a start-up."""

    def __init__(self, send: Callable[[str], None], interval_s: float = INTERVAL_S,
                 limits: dict[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.send, self.interval_s, self.clock = send, interval_s, clock
        self.limits = PHASE_LIMITS_S if limits is None else limits
        self.phase: str | None = None
        self.reporter: Any = None  # the StatusReporter `send` uses, for the Session to share
        self._deadline = 0.0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kuberl-startup-heartbeat",
                                         daemon=True)
        self._thread.start()

    def enter(self, phase: TrainerPhase) -> None:
        """The start-up is in `phase` from now: beat at once, then on the interval."""
        with self._lock:
            self.phase = phase
            self._deadline = self.clock() + self.limits.get(phase, self.interval_s)
        self.beat()

    def beat(self) -> bool:
        """One beat, if the current phase is within its limit; whether it was sent."""
        with self._lock:
            phase = self.phase
            due = (phase is not None and not self._stopped.is_set()
                   and self.clock() < self._deadline)
        if not due or phase is None:
            return False
        try:
            self.send(phase)
        except Exception as exc:  # best effort, as the per-step report
            LOG.warning("could not report the start-up heartbeat to the RLJob status: %s", exc)
            return False
        return True

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.beat()
