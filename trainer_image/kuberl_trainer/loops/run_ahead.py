"""How far ahead of the trainers mode async lets the engines generate (pure):
``async.runAhead``.

`maxStaleness` bounds how old a sample may be; it says nothing about how far ahead the engines
should run. Running ahead buys throughput only when generation cannot keep up otherwise: when
the engines are faster than the trainers, every rollout generated beyond the next one only
waits in the buffer, and trains on weights more versions old. On the demo job (addition, lr
2e-4, one CPU engine, far faster than the trainer) the engines sat at the bound of 4 and async
kept 62% of sync's gain over 100 steps (bench/RESULTS.md, "Async off-policy correction").

``adaptive`` keeps a *depth*, a staleness bound of its own between 1 (one-step-off) and
maxStaleness: the rollout that will train under policy version v starts once the engines hold
weights of version v - depth, exactly as maxStaleness's rule with the depth in its place. The
trainers' idle time is the signal, as in TCP's congestion window: a step on which the trainers
waited for a rollout (or for the engines to finish one before an update) deepens it at once;
`PATIENCE` steps in a row that found a rollout already waiting behind the one taken, with no
wait, shallow it by one. When generation is the slower side the depth climbs to the bound and
the loop behaves as ``bound`` does; when it is the faster side the depth settles at 1 and
samples are as fresh as one-step-off's, with the same throughput (the trainers never wait).
``bound`` always runs to the bound: the deepest buffer against bursty generation, at the
staleness's price.
"""

from __future__ import annotations

from dataclasses import dataclass

from kuberl_api.spec import RunAhead

# The trainers "waited" when idle for more than this share of their step's training: start-up
# jitter and the loop's own bookkeeping (milliseconds) are not a starving buffer.
STARVED_SHARE = 0.05
# Steps in a row with a surplus (and no wait) before the depth shrinks by one: a burst of slow
# rollouts a few steps apart should not have to deepen the buffer from scratch each time.
PATIENCE = 3


@dataclass
class RunAheadDepth:
    """The depth and the evidence behind it; ``observe`` after every step."""

    max_staleness: int
    mode: RunAhead = "adaptive"
    depth: int = 1
    surplus_steps: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(f"maxStaleness must be at least 1, got {self.max_staleness}")
        if self.mode == "bound":
            self.depth = self.max_staleness

    def observe(self, *, trainers_idle_s: float, train_s: float, waiting_after: int) -> int:
        """One step's evidence: how long the trainers were idle (waiting for its rollout, or
        for the engines before the update), how long they trained, and how many rollouts were
        still waiting after this step's was taken. Returns the new depth."""
        if self.mode == "bound":
            return self.depth
        if trainers_idle_s > STARVED_SHARE * train_s:
            self.depth = min(self.depth + 1, self.max_staleness)
            self.surplus_steps = 0
        elif waiting_after > 0:
            self.surplus_steps += 1
            if self.surplus_steps >= PATIENCE:
                self.depth = max(self.depth - 1, 1)
                self.surplus_steps = 0
        else:
            self.surplus_steps = 0
        return self.depth
