"""An eval set's scores from each problem's samples: avg@k, pass@k and maj@k.

Each problem has n samples in the order they were drawn (sample index 0..n-1), each with its
reward, whether it passed (its reward reached the set's passThreshold) and its answer (what the
reward compares; None when it has none). For k <= n:

- avg@k: the mean reward of each problem's first k samples, averaged over problems.
- pass@k: the chance that at least one of k samples drawn from the problem's n passes, by
  Chen et al. (2021)'s unbiased estimator 1 - C(n-c, k) / C(n, k) (c: the passes among n),
  averaged over problems. Computed as a product, never as binomials (which overflow floats
  from n ~ 1030 on, and lose precision long before).
- maj@k: the reward of the majority answer among each problem's first k samples, averaged
  over problems. The answer most samples gave wins; a tie goes to the answer that came first;
  samples without an answer do not vote, and a problem where none has one scores 0.

Pure: numbers in, numbers out (tests/unit/test_eval_metrics.py checks them by hand).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sampled:
    """One sample of a problem: its reward, whether it passed, its answer."""

    reward: float
    passed: bool
    answer: str | None = None


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of n samples, c of them passing, drawn
    without replacement, hold at least one pass. C(n-c, k) / C(n, k) is the product over
    i = n-c+1..n of (1 - k/i), each factor in [0, 1]."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k holds a pass
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def avg_at_k(problems: Sequence[Sequence[Sampled]], k: int) -> float:
    return statistics.fmean(statistics.fmean(s.reward for s in p[:k]) for p in _checked(
        problems, k))


def mean_pass_at_k(problems: Sequence[Sequence[Sampled]], k: int) -> float:
    return statistics.fmean(pass_at_k(len(p), sum(s.passed for s in p), k)
                            for p in _checked(problems, k))


def maj_at_k(problems: Sequence[Sequence[Sampled]], k: int) -> float:
    return statistics.fmean(_majority_reward(p[:k]) for p in _checked(problems, k))


def _majority_reward(samples: Sequence[Sampled]) -> float:
    votes = Counter(s.answer for s in samples if s.answer is not None)
    if not votes:
        return 0.0
    # Counter keeps first-seen order and max() returns the first of equals: a tie goes to the
    # answer that came first
    winner = max(votes, key=lambda a: votes[a])
    return next(s.reward for s in samples if s.answer == winner)


def scores(problems: Sequence[Sequence[Sampled]], ks: Sequence[int], *,
           majority: bool) -> dict[str, float]:
    """avg@k, pass@k and (when answers can be compared: `majority`) maj@k for each k, over
    the problems with at least k samples (a failed episode leaves its problem one short);
    none for a k no problem has that many samples for."""
    out: dict[str, float] = {}
    for k in ks:
        enough = [p for p in problems if len(p) >= k]
        if not enough:
            continue
        out[f"avg@{k}"] = avg_at_k(enough, k)
        out[f"pass@{k}"] = mean_pass_at_k(enough, k)
        if majority:
            out[f"maj@{k}"] = maj_at_k(enough, k)
    return out


def _checked(problems: Sequence[Sequence[Sampled]], k: int) -> Sequence[Sequence[Sampled]]:
    if not problems:
        raise ValueError("no problems to score")
    short = min(len(p) for p in problems)
    if not 1 <= k <= short:
        raise ValueError(f"k={k} needs 1 <= k <= the samples of every problem (fewest: {short})")
    return problems
