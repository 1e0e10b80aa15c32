"""What mode async measures each step (pure): how stale the trained samples were, and how well
generation and training overlapped.

Versions count the trainer's updates: the policy that trains at step k has made `k` of them
(its weights are version k). Each row comes with two versions (rollout.generate.Response): its
oldest model token's (`weight_version`: the oldest weights that can have sampled it, since an
engine reports only the version it held when a request finished; agents.context) and the
newest its engine reported (`newest_version`: newer when an update came while the row was
generated, a partial rollout, or between a trajectory's turns). A row's staleness is the
policy's version minus its oldest token's: 0 in sync mode, 1 for every row after the first
step in one-step-off, at most `async.maxStaleness` in any step, for every token.
"""

from __future__ import annotations

from collections.abc import Sequence

from kuberl_trainer.agents.trajectory import INITIAL_VERSION, version_number

__all__ = ["INITIAL_VERSION", "behaviour_version", "overlap_times", "staleness_metrics"]


def behaviour_version(reported: str | None, fallback: int) -> int:
    """The weight version an engine reported with a response, or `fallback` when it reports
    none."""
    number = version_number(reported)
    return fallback if number is None else number


def staleness_metrics(trained_from: int, versions: Sequence[tuple[str | None, str | None]],
                      submitted: int, max_staleness: int | None = None) -> dict[str, float]:
    """`trained_from`: the version of the policy that trains on the rows; `versions`: each
    row's (oldest token's, newest reported) version; `submitted`: the version the engines held
    when the rollout was submitted (a row without versions is taken as of it). Staleness
    counts a row's oldest token. The bound (`max_staleness`) keeps every token within it, so
    none is dropped (`dropped_stale_samples` 0); a row past it, or with a version that cannot
    be, is an error (the loop broke its own rule)."""
    oldest = [behaviour_version(old, submitted) for old, _ in versions]
    newest = [max(behaviour_version(new, o), o) for (_, new), o in zip(versions, oldest,
                                                                        strict=True)]
    if any(v < submitted for v in oldest):
        raise ValueError(f"an engine reported weight version {min(oldest)}, older than the "
                         f"{submitted} it held when the rollout began: an update did not land")
    if any(v > trained_from for v in newest) or submitted > trained_from:
        raise ValueError(f"a sample's weight version is newer than the policy training on it "
                         f"(version {trained_from}; reported {sorted(set(newest))})")
    lags = [float(trained_from - v) for v in oldest]
    if max_staleness is not None and lags and max(lags) > max_staleness:
        raise ValueError(f"a row's oldest token is of weight version {min(oldest)}, "
                         f"{max(lags):.0f} versions behind the policy training on it "
                         f"(version {trained_from}): past async.maxStaleness {max_staleness}")
    spanned = sum(new > old for old, new in zip(oldest, newest, strict=True))
    return {"staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness_max": max(lags, default=0.0),
            "partial_rollout_fraction": spanned / len(lags) if lags else 0.0,
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
