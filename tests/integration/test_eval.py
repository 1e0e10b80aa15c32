"""Evaluation: a training run's scores of its eval sets, and mode eval's of the checkpoint it
saved, are the same numbers (the eval samples' seeds are the set's, the problem's and the
sample's, never the step's: rollout/evaluation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.integration.local_run import failed, kuberl_run, manifest, metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_mode_eval_of_a_checkpoint_gives_the_training_runs_scores(tiny: Path,
                                                                   tmp_path: Path) -> None:
    problems = tmp_path / "eval.jsonl"  # (the set's first 48 problems: seconds, not minutes)
    problems.write_text("".join((tiny / "data" / "eval.jsonl").read_text()
                                .splitlines(keepends=True)[:48]))
    evals = [{"name": "addition", "path": str(problems), "nSamplesPerPrompt": 4,
              "passK": [1, 2, 4]}]
    train = manifest(tiny, tmp_path, "train", data={"evalSets": evals},
                     schedule={"numRollouts": 2, "evalInterval": 2, "saveInterval": 2})
    res = kuberl_run(train, tmp_path / "train")
    assert res.returncode == 0, failed(res)
    trained = {k: v for k, v in metrics(tmp_path / "train")[-1].items()
               if k.startswith("eval_")}
    assert set(trained) == {"eval_addition_reward", *(f"eval_addition_{m}@{k}"
                                                      for k in (1, 2, 4)
                                                      for m in ("avg", "pass", "maj"))}
    assert 0 < trained["eval_addition_pass@1"] < trained["eval_addition_pass@4"] <= 1

    # mode eval: the checkpoint's model, the same eval set and seed; no prompts, nothing trains
    doc = yaml.safe_load(manifest(tiny, tmp_path, "eval", mode="eval",
                                  model={"path": str(tmp_path / "train" / "checkpoints" /
                                                     "step_2" / "model")},
                                  data={"evalSets": evals}).read_text())
    del doc["spec"]["data"]["prompts"], doc["spec"]["schedule"]
    job = tmp_path / "eval.yaml"
    job.write_text(yaml.safe_dump(doc))
    res = kuberl_run(job, tmp_path / "eval")
    assert res.returncode == 0, failed(res)
    (row,) = metrics(tmp_path / "eval")
    assert row["step"] == 2  # the checkpoint's
    assert {k: v for k, v in row.items() if k.startswith("eval_")} == trained  # exactly
    assert not (tmp_path / "eval" / "checkpoints").exists()  # trained nothing, saved nothing
