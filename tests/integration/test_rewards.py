"""reward.type remote end to end: `kuberl run` grading through a reward service on loopback
(tests/reward_server.py, exact match over HTTP, in a thread of the test's process).

One training run covers the service's normal life, behind auth (reward.auth's credential
from the run's environment): its first two steps, with a share of
batches answered 503 on their first attempt and batches of 5 crossing groups of 8, train
exactly what the same job with reward.type exact trains (the uninterrupted run the resume
tests share); its last step, with one batch failing on every attempt under onError drop,
leaves exactly that batch's groups out and says so in its metrics. A second job, mode eval
(engines only: the cheapest job that grades), shows a persistent 500 under onError fail
ending the job with an error that names reward.url and quotes the server.
(The contract's corners, the retry rules and the drop bookkeeping sample by sample are the
unit tests' tests/unit/test_reward_service.py and tests/unit/test_grading.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl_api.runtime import ENV_REWARD_AUTH
from tests.integration.local_run import failed, kuberl_run, manifest, metrics
from tests.integration.test_local_run import RESUMABLE, whole_run
from tests.reward_server import RewardServer, dumps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GROUPS, N = 16, 8  # the tiny job's rolloutBatchSize and nSamplesPerPrompt (local_run.manifest)


def test_a_reward_service_trains_as_the_builtin_retries_and_drops_failed_groups(
        tiny: Path, tmp_path: Path, shared_run: Callable[[str, Path], Path]) -> None:
    doomed: set[str] = set()

    def broken(item: dict[str, Any]) -> bool:
        """The last step's first batch to arrive fails every time (its retries: the same
        ids); no other does."""
        if item["id"].startswith("2:") and not doomed:
            doomed.add(item["id"])
        return item["id"] in doomed

    server = RewardServer(flaky=0.3, broken=broken, token="s3cret")  # (behind auth)
    with server.in_thread() as url:
        job = manifest(tiny, tmp_path, "remote", schedule={"numRollouts": 3, "saveInterval": 3},
                       reward={"type": "remote", "url": url, "batchSize": 5, "maxRetries": 2,
                               "onError": "drop", "auth": {"secret": "grader"}})
        res = kuberl_run(job, tmp_path / "out", env={ENV_REWARD_AUTH: "s3cret"})
    assert res.returncode == 0, failed(res) + "\n" + dumps(server)
    rows = metrics(tmp_path / "out")
    whole = metrics(whole_run(tiny, tmp_path, shared_run, "grpo"))  # reward.type exact

    # steps 0 and 1: what the built-in trains, batches crossing groups, retries counted
    for remote, builtin in zip(rows[:2], whole[:2], strict=True):
        assert remote["prompts_sha"] == builtin["prompts_sha"]
        for key in RESUMABLE["grpo"][1]:
            assert remote[key] == pytest.approx(builtin[key], rel=1e-4, abs=1e-5), key
        assert remote["reward_errors"] == 0 and "kept_group_fraction" not in remote
    assert rows[0]["reward_mean"] == whole[0]["reward_mean"]  # one policy, one rollout: exact
    sizes = {len(r.ids) for r in server.requests}
    assert sizes == {5, 3}  # 128 samples: 25 batches of 5 and one of 3, over groups of 8
    busy = [r for r in server.requests if r.status == 503]
    assert busy and sum(r["reward_retries"] for r in rows[:2]) == sum(
        not r.ids[0].startswith("2:") for r in busy)
    assert all(r["reward_s"] > 0 for r in rows)

    # step 2: the doomed batch, tried 1 + maxRetries times, takes out its samples' groups
    last = rows[2]
    failures = [r for r in server.requests if r.status == 500]
    assert len(failures) == 3 and len({tuple(r.ids) for r in failures}) == 1, dumps(server)
    groups = {i.rsplit(":", 1)[0] for i in failures[0].ids}  # step:epoch:index, its prompt's
    assert last["reward_errors"] == 5
    assert last["reward_dropped_groups"] == len(groups) in (1, 2)
    assert last["kept_group_fraction"] == pytest.approx(1 - len(groups) / GROUPS)
    served = {i for r in server.served if r.ids[0].startswith("2:") for i in r.ids}
    assert len(served) == GROUPS * N - 5  # every other sample graded, once
    assert last["reward_retries"] == 2 + sum(r.ids[0].startswith("2:") for r in busy)


def test_a_reward_service_that_keeps_failing_ends_the_job_quoting_it(
        tiny: Path, tmp_path: Path) -> None:
    problems = tmp_path / "eval.jsonl"  # (a few problems: the job fails on its first batch)
    problems.write_text("".join((tiny / "data" / "eval.jsonl").read_text()
                                .splitlines(keepends=True)[:4]))
    server = RewardServer(broken=lambda item: True, broken_status=500)
    with server.in_thread() as url:
        doc = yaml.safe_load(manifest(
            tiny, tmp_path, "eval", mode="eval",
            data={"evalSets": [{"name": "addition", "path": str(problems)}]},
            reward={"type": "remote", "url": url, "maxRetries": 1}).read_text())
        del doc["spec"]["data"]["prompts"], doc["spec"]["schedule"]
        job = tmp_path / "eval.yaml"
        job.write_text(yaml.safe_dump(doc))
        res = kuberl_run(job, tmp_path / "out")
    assert res.returncode != 0, failed(res)
    assert (f"RewardError: reward.url {url}: a batch of 4 samples failed after 2 attempts "
            "(reward.maxRetries 1); the last: HTTP 500: grader crashed on eval:addition:"
            ) in res.stderr, failed(res)
    assert len(server.requests) == 2
