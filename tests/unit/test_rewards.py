"""Reward functions on realistic strings, and loading them from a RewardSpec."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from kuberl_api.spec import RewardSpec
from kuberl_trainer.rollout import rewards
from kuberl_trainer.rollout.grading import load_grader
from kuberl_trainer.rollout.rewards import (
    RewardError,
    RewardInput,
    RewardLoadError,
    exact_match,
    math_reward,
    token_f1,
)


@pytest.mark.parametrize(("response", "label", "expected"), [
    ("The sum is 40 + 2, so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{42}", "42", 1.0),
    ("42", "\\boxed{42}", 1.0),                               # boxed label, bare answer
    ("\\boxed{41}", "42", 0.0),
    ("We get \\boxed{\\frac{1}{2}}", "0.5", 1.0),             # fraction vs decimal
    ("The answer is $\\frac12$", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{3}}", "\\frac{4}{6}", 1.0),           # unreduced label
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{1+x^2}", "x^2+1", 1.0),                         # symbolic, bare-LaTeX label
    ("First I guessed 41, but \\boxed{42}", "41", 0.0),       # the boxed answer wins
    ("I don't know", "42", 0.0),
    ("\\boxed{{{", "42", 0.0),                                # malformed LaTeX
    ("", "42", 0.0),
    ("\\boxed{42}", "", 0.0),                                 # unusable label
])
def test_math(response: str, label: str, expected: float) -> None:
    assert math_reward(response, label) == expected


def test_math_works_off_the_main_thread() -> None:
    # math-verify's signal-based timeout raises off the main thread; the reward must not.
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.append(math_reward("\\boxed{42}", "42")))
    worker.start()
    worker.join()
    assert results == [1.0]


@pytest.mark.parametrize(("response", "label", "expected"), [
    ("  Hello \n  World ", "hello world", 1.0),   # whitespace and case only
    ("PARIS", "paris", 1.0),
    ("42.", "42", 0.0),                          # punctuation matters
    ("The answer is 42", "42", 0.0),             # no answer extraction: exact is exact
    ("", "", 1.0),
])
def test_exact(response: str, label: str, expected: float) -> None:
    assert exact_match(response, label) == expected


def test_f1_partial_overlap_by_hand() -> None:
    # response -> [cat, sat, on, mat] (articles "the" dropped); label -> [cat, on, hat]
    # common = {cat, on} = 2; precision 2/4, recall 2/3
    # F1 = 2 * 1/2 * 2/3 / (1/2 + 2/3) = (2/3) / (7/6) = 4/7 = 0.571429
    assert token_f1("The cat sat on the mat.", "a cat on a hat") == pytest.approx(4 / 7)


def test_f1_counts_multiplicity_and_normalises() -> None:
    # [paris, paris] vs [paris]: common 1, precision 1/2, recall 1 -> F1 = 2/3.
    assert token_f1("Paris paris", "paris") == pytest.approx(2 / 3)
    assert token_f1("Paris!", "the paris") == 1.0
    assert token_f1("London", "Paris") == 0.0
    # No tokens on one side (only an article): 0; on both sides: 1.
    assert token_f1("the", "Paris") == 0.0
    assert token_f1("", "a") == 1.0


def test_load_builtins() -> None:
    assert rewards.load(RewardSpec(type="math")) is math_reward
    assert rewards.load(RewardSpec(type="exact")) is exact_match
    assert rewards.load(RewardSpec(type="f1")) is token_f1
    assert rewards.load(RewardSpec()) is math_reward  # the spec's default
    # a service and an environment call no function of the head's
    assert rewards.load(RewardSpec(type="remote", url="http://rm:8000/score")) is None
    assert rewards.load(RewardSpec(type="environment")) is None


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_load_custom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, monkeypatch, "kuberl_test_reward_ok",
            "def length_match(response, label):\n    return len(response) == len(label)\n"
            "def boom(response, label):\n    raise RuntimeError('bug in user code')\n")
    items = [RewardInput("s:0", "p", "abc", "xyz"), RewardInput("s:1", "p", "ab", "xyz")]
    grader = load_grader(RewardSpec(type="custom",
                                    function="kuberl_test_reward_ok:length_match"))
    assert grader.scorer is not None
    scored = asyncio.run(grader.scorer.score(items))
    assert scored.rewards == [1.0, 0.0] and all(type(r) is float for r in scored.rewards)
    boom = load_grader(RewardSpec(type="custom", function="kuberl_test_reward_ok:boom"))
    assert boom.scorer is not None
    with pytest.raises(RewardError) as info:  # user bugs surface, never as a reward of 0
        asyncio.run(boom.scorer.score(items))
    assert str(info.value) == ("reward function kuberl_test_reward_ok:boom raised on sample "
                               "s:0: RuntimeError: bug in user code")
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(("body", "function", "message"), [
    (None, "kuberl_no_such_module:fn",
     "cannot import module 'kuberl_no_such_module' of reward function "
     "'kuberl_no_such_module:fn'"),
    ("import kuberl_missing_dependency\n", "kuberl_test_reward_bad:fn",
     "cannot import module 'kuberl_test_reward_bad'.*ModuleNotFoundError"),
    ("def fn(:\n", "kuberl_test_reward_bad:fn", "cannot import.*SyntaxError"),
    ("x = 1\n", "kuberl_test_reward_bad:fn",
     "'kuberl_test_reward_bad:fn': module 'kuberl_test_reward_bad' has no attribute 'fn'"),
    ("fn = 3\n", "kuberl_test_reward_bad:fn",
     "'kuberl_test_reward_bad:fn' is not callable \\(got an object of type int\\)"),
])
def test_load_custom_errors_name_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          body: str | None, function: str,
                                          message: str) -> None:
    if body is not None:
        _module(tmp_path, monkeypatch, "kuberl_test_reward_bad", body)
    with pytest.raises(RewardLoadError, match=message) as info:
        rewards.load(RewardSpec(type="custom", function=function))
    assert isinstance(info.value, ImportError)
