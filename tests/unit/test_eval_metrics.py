"""avg@k, pass@k and maj@k against values worked out by hand (algos/eval_metrics.py), and the
answers maj@k votes on (rollout/rewards/answers.py)."""

from __future__ import annotations

from fractions import Fraction
from math import comb
from pathlib import Path

import pytest

from kuberl_api.spec import RewardSpec
from kuberl_trainer.algos.eval_metrics import (
    Sampled,
    avg_at_k,
    maj_at_k,
    mean_pass_at_k,
    pass_at_k,
    scores,
)
from kuberl_trainer.rollout.rewards import exact_match
from kuberl_trainer.rollout.rewards.answers import answer_fn


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 2, 2, 1 - 3 / 10),      # 1 - C(3,2)/C(5,2)
    (4, 1, 1, 1 / 4),           # pass@1 is the pass rate
    (4, 1, 2, 1 - 3 / 6),       # 1 - C(3,2)/C(4,2)
    (10, 3, 5, 11 / 12),        # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (4, 3, 2, 1.0),             # n - c < k: every 2 of the 4 hold a pass
    (8, 0, 8, 0.0),             # no pass, ever
    (8, 8, 1, 1.0),
])
def test_pass_at_k_equals_the_closed_form(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(("n", "c", "k"), [(1024, 3, 512), (1024, 1, 1), (1024, 100, 7),
                                           (1024, 1000, 20)])
def test_pass_at_k_matches_exact_rationals_at_the_largest_n(n: int, c: int, k: int) -> None:
    # (C(1024, 512) ~ 4.5e306: a float's limit is near; the product form never forms it)
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_at_k_refuses_k_beyond_the_samples() -> None:
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def _problem(rewards: list[float], answers: list[str | None] | None = None,
             threshold: float = 1.0) -> list[Sampled]:
    answers = answers or [None] * len(rewards)
    return [Sampled(r, r >= threshold, a) for r, a in zip(rewards, answers, strict=True)]


PROBLEMS = [_problem([1, 0, 1, 1], ["a", "b", "a", "a"]), _problem([0, 0, 0, 1],
                                                                   ["b", "b", "c", "a"])]


def test_avg_at_k_is_the_mean_of_each_problems_first_k() -> None:
    assert avg_at_k(PROBLEMS, 1) == 0.5                      # (1 + 0) / 2
    assert avg_at_k(PROBLEMS, 2) == 0.25                     # (1/2 + 0) / 2
    assert avg_at_k(PROBLEMS, 4) == 0.5                      # (3/4 + 1/4) / 2


def test_pass_at_k_is_averaged_over_problems() -> None:
    assert mean_pass_at_k(PROBLEMS, 1) == 0.5                # (3/4 + 1/4) / 2
    assert mean_pass_at_k(PROBLEMS, 2) == 0.75               # (1 + (1 - 3/6)) / 2


def test_maj_at_k_scores_the_majority_answer() -> None:
    # first problem: a wins (reward 1); second: b wins among 4 (reward 0)
    assert maj_at_k(PROBLEMS, 4) == 0.5
    assert maj_at_k(PROBLEMS, 1) == 0.5                      # maj@1: the first sample's


def test_maj_at_k_tie_goes_to_the_answer_that_came_first() -> None:
    tie = [_problem([1, 0, 0, 1], ["a", "b", "b", "a"])]
    assert maj_at_k(tie, 4) == 1.0                           # a 2, b 2: a came first
    assert maj_at_k(tie, 3) == 0.0                           # b 2, a 1
    other = [_problem([0, 1, 1, 0], ["b", "a", "a", "b"])]
    assert maj_at_k(other, 4) == 0.0                         # b came first


def test_samples_without_an_answer_do_not_vote() -> None:
    assert maj_at_k([_problem([1, 1, 0], [None, None, "x"])], 3) == 0.0
    assert maj_at_k([_problem([1, 1], [None, None])], 2) == 0.0


def test_scores_names_each_metric_and_leaves_out_maj_without_answers() -> None:
    assert scores(PROBLEMS, [1, 4], majority=True) == {
        "avg@1": 0.5, "pass@1": 0.5, "maj@1": 0.5,
        "avg@4": 0.5, "pass@4": 1.0, "maj@4": 0.5}
    assert set(scores(PROBLEMS, [2], majority=False)) == {"avg@2", "pass@2"}


def test_a_problem_short_of_k_samples_is_left_out_of_that_k() -> None:
    # (a failed episode leaves its problem one short)
    short = [_problem([1, 1]), _problem([0, 0, 0])]
    assert scores(short, [2, 3], majority=False) == {
        "avg@2": 0.5, "pass@2": 0.5, "avg@3": 0.0, "pass@3": 0.0}


def test_the_pass_threshold_decides_a_pass() -> None:
    graded = [_problem([0.5, 0.2], threshold=0.5)]
    assert mean_pass_at_k(graded, 1) == 0.5
    assert avg_at_k(graded, 2) == pytest.approx(0.35)


def test_answers_are_what_the_reward_compares() -> None:
    exact = answer_fn(RewardSpec(type="exact"), exact_match)
    assert exact is not None and exact("  The  Answer ") == exact("the answer")
    f1 = answer_fn(RewardSpec(type="f1"), exact_match)
    assert f1 is not None and f1("The answer!") == f1("answer")
    math = answer_fn(RewardSpec(type="math"), exact_match)
    assert math is not None and math(r"so \boxed{\frac12}") == math("the answer is 1/2")
    assert math("no answer here") is None
    assert answer_fn(RewardSpec(type="environment"), exact_match) is None


def test_a_custom_reward_votes_only_with_its_own_answer(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from kuberl_trainer.rollout.rewards.custom import import_reward

    (tmp_path / "graders.py").write_text(
        "def plain(response, label):\n    return float(response == label)\n\n"
        "def voting(response, label):\n    return float(response.strip() == label)\n\n"
        "voting.answer = str.strip\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, votes in (("plain", False), ("voting", True)):
        spec = RewardSpec(type="custom", function=f"graders:{name}")
        answer = answer_fn(spec, import_reward(f"graders:{name}"))
        assert (answer is not None) == votes
    answer = answer_fn(RewardSpec(type="custom", function="graders:voting"),
                       import_reward("graders:voting"))
    assert answer is not None and answer(" 7 ") == "7"
