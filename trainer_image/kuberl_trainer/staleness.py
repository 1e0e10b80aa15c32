"""What mode async measures each step (pure): how stale the trained samples were, and how well
generation and training overlapped.

Versions count the trainer's updates: the policy that trains at step k has made `k` of them
(its weights are version k), and an engine reports, with every response, the version of the
weights it generated under (`meta_info.weight_version`, set by each weight update). A sample's
staleness is the difference: 0 in sync mode, 1 for every sample after the first step in
one-step-off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# What an engine reports before its first weight update (SGLang's default, and the reference
# engine's): the base model, version 0.
INITIAL_VERSION = "default"


def behaviour_version(reported: str | None, fallback: int) -> int:
    """The weight version a response was generated under: the engine's report, or `fallback`
    (the version the loop last sent) when the engine reports none."""
    if reported is None:
        return fallback
    if reported == INITIAL_VERSION:
        return 0
    try:
        return int(reported)
    except ValueError:
        raise ValueError(f"engine reported weight_version {reported!r}: kuberl sets "
                         "integers (the trainer's update count); was the engine updated by "
                         "something else?") from None


def staleness_metrics(trained_from: int, versions: Sequence[str | None],
                      fallback: int | None = None) -> dict[str, float]:
    """`trained_from`: the version of the policy that trains on the samples; `versions`: each
    sample's reported weight version. Nothing is dropped in one-step-off (no sample can lag
    more than one version), so `dropped_stale_samples` is 0."""
    lags = [trained_from - behaviour_version(v, trained_from if fallback is None else fallback)
            for v in versions]
    if any(lag < 0 for lag in lags):
        raise ValueError(f"a sample's weight version is newer than the policy training on it "
                         f"(version {trained_from}; reported {sorted(set(map(str, versions)))})")
    return {"staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness_max": float(max(lags, default=0)), "dropped_stale_samples": 0.0}


@dataclass
class Phases:
    """Seconds from the start of a step's overlap until each side finished."""

    train_s: float = 0.0
    generate_s: float = 0.0  # the next step's rollout; 0 when none was generated (last step)


def overlap_times(phases: Phases, *, sync_s: float, step_s: float) -> dict[str, float]:
    """The step's times: training and sync as in sync mode; `time_wait_rollout_s`, the
    trainers idle until the next rollout was ready; `time_wait_train_s`, the engines idle
    until training was done; `overlap_fraction`, the share of the step both were busy;
    `overlap_efficiency`, the step's time over the longer of generating and
    training-then-syncing (1.0: the shorter side cost nothing)."""
    train, generate = phases.train_s, phases.generate_s
    longest = max(generate, train + sync_s)
    return {"time_train_s": train, "time_sync_s": sync_s, "time_step_s": step_s,
            "time_wait_rollout_s": max(0.0, generate - train),
            "time_wait_train_s": max(0.0, train - generate),
            "overlap_fraction": min(train, generate) / step_s if step_s > 0 else 0.0,
            "overlap_efficiency": step_s / longest if longest > 0 else 1.0}
