"""What mode async measures each step (pure): how stale the trained samples were, and how well
generation and training overlapped.

Versions count the trainer's updates: the policy that trains at step k has made `k` of them
(its weights are version k). The loop knows the version the engines held when a rollout was
submitted (its responses' oldest tokens are of it), and an engine reports, with every
response, the version it held when the response finished (`meta_info.weight_version`, set by
each weight update): newer than the submitted one when an update came while the response was
generated (a partial rollout). A sample's staleness is the policy's version minus its oldest
token's: 0 in sync mode, 1 for every sample after the first step in one-step-off, at most
`async.maxStaleness` in any step.
"""

from __future__ import annotations

from collections.abc import Sequence

# What an engine reports before its first weight update (SGLang's default, and the reference
# engine's): the base model, version 0.
INITIAL_VERSION = "default"


def behaviour_version(reported: str | None, fallback: int) -> int:
    """The weight version an engine reported with a response, or `fallback` when it reports
    none."""
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


def staleness_metrics(trained_from: int, reported: Sequence[str | None],
                      submitted: int) -> dict[str, float]:
    """`trained_from`: the version of the policy that trains on the samples; `reported`: each
    response's version as its engine reported it; `submitted`: the version the engines held
    when the rollout was submitted. Staleness counts a response's oldest token; the bound
    keeps every sample within it, so none is dropped (`dropped_stale_samples` 0)."""
    newest = [behaviour_version(v, submitted) for v in reported]
    if any(v < submitted for v in newest):
        raise ValueError(f"an engine reported weight version {min(newest)}, older than the "
                         f"{submitted} it held when the rollout began: an update did not land")
    if any(v > trained_from for v in newest) or submitted > trained_from:
        raise ValueError(f"a sample's weight version is newer than the policy training on it "
                         f"(version {trained_from}; reported {sorted(set(newest))})")
    lag = float(trained_from - submitted)
    spanned = sum(v > submitted for v in newest)
    return {"staleness_mean": lag if newest else 0.0, "staleness_max": lag if newest else 0.0,
            "partial_rollout_fraction": spanned / len(newest) if newest else 0.0,
            "dropped_stale_samples": 0.0}


def overlap_times(*, train_s: float, sync_s: float, step_s: float, trainers_idle_s: float,
                  engines_idle_s: float, generating_s: float) -> dict[str, float]:
    """The step's times: training and sync as in sync mode; `time_wait_rollout_s`, the
    trainers idle (waiting for a rollout, or for the engines to be free for the update);
    `time_wait_train_s`, the engines idle (held back by the bound, or by an update);
    `overlap_fraction`, min(training, generating) over the step: the share of it both sides
    were busy, when training and generation run side by side;
    `overlap_efficiency`, the step's time over the longer of generating and training plus
    syncing (1.0: the shorter side cost nothing)."""
    longest = max(generating_s, train_s + sync_s)
    both = min(train_s, generating_s)  # (exact when both start together, as in one-step-off)
    return {"time_train_s": train_s, "time_sync_s": sync_s, "time_step_s": step_s,
            "time_wait_rollout_s": trainers_idle_s, "time_wait_train_s": engines_idle_s,
            "overlap_fraction": both / step_s if step_s > 0 else 0.0,
            "overlap_efficiency": step_s / longest if longest > 0 else 1.0}
