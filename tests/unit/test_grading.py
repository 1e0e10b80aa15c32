"""The grading stage through the rollout manager (its generate, its evaluate): a reward service on
loopback (tests/reward_server.py, a real HTTP server doing exact match) grades a step exactly
as reward.type exact does, batches crossing group boundaries; retries leave the rewards as
they were and are counted; under onError drop exactly the groups with a sample of a failed
batch leave the loss; under fail the step fails quoting the server. The user's function in
each of its forms (one sample or the step's samples, plain or async) makes the same batch.

The engine is the table stand-in of test_rollout_manager (the right answer on an even seed);
what is under test is how responses are graded and what the step does with the grades."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl_api import parse
from kuberl_api.spec import RewardSpec
from kuberl_trainer.rollout.grading import load_grader
from kuberl_trainer.rollout.manager import Rollout, RolloutError, RolloutManager
from kuberl_trainer.rollout.prompts import PromptSource
from kuberl_trainer.rollout.rewards import RewardError, RewardLoadError
from tests.integration.tiny_model import build_tokenizer
from tests.reward_server import RewardServer
from tests.unit.test_rollout_manager import TableEngine

TOK = build_tokenizer()
GROUPS, N, BATCH = 4, 4, 3  # 16 samples in batches of 3: every other batch spans two groups
ROWS = [{"prompt": f"{a}+{a}=", "label": str(2 * a), "level": a % 3} for a in range(10, 20)]


def manager(tmp_path: Path, reward: dict[str, Any], **data: Any
            ) -> tuple[RolloutManager, TableEngine]:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    spec = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
                  "spec": {"model": {"path": "/m"},
                           "data": {"prompts": str(path), "rolloutBatchSize": GROUPS,
                                    "nSamplesPerPrompt": N, "maxResponseLen": 4,
                                    "evalSets": [{"name": "add", "path": str(path),
                                                  "nSamplesPerPrompt": 2, "passK": [1, 2]}],
                                    **data},
                           "reward": reward, "schedule": {"evalInterval": 1},
                           "training": {"backend": "fsdp", "gpusPerNode": 0},
                           "rollout": {"engine": "reference"}}}).spec
    engine = TableEngine({r["prompt"]: r["label"] for r in ROWS}, TOK)
    source = PromptSource(path, "prompt", "label", seed=0,
                          metadata_keys=spec.data.metadata_keys)
    return RolloutManager(spec, source, engine, TOK, load_grader(spec.reward),  # type: ignore[arg-type]
                          seed=7), engine


def remote(url: str, **settings: Any) -> dict[str, Any]:
    return {"type": "remote", "url": url, "batchSize": BATCH, **settings}


def rollout(mgr: RolloutManager, step: int = 3) -> Rollout:
    return asyncio.run(mgr.generate(step))


def same_batch(a: Rollout, b: Rollout) -> None:
    for name in ("input_ids", "loss_mask", "advantages", "rollout_logprobs"):
        assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name
    for key in ("reward_mean", "reward_std", "advantage_mean", "advantage_std"):
        assert a.metrics[key] == b.metrics[key], key


def test_a_reward_service_grades_a_step_as_the_builtin_does(tmp_path: Path) -> None:
    """Per sample: the same reward as type exact, on the same responses, whichever form the
    server answers in and whatever order its batches finish in; batches of 3 over groups of
    4 (samples of two prompts in one request); ids of the step, the sample and its seed."""
    async def graded() -> tuple[Rollout, RewardServer]:
        async with RewardServer(answer="alternate",
                                delay=lambda ids: 0.02 * (hash(ids[0]) % 3)) as server:
            mgr, _ = manager(tmp_path, remote(server.url))
            return await mgr.generate(3), server

    served, server = asyncio.run(graded())
    builtin = rollout(manager(tmp_path, {"type": "exact"})[0])
    same_batch(served, builtin)
    assert [len(r.ids) for r in sorted(server.requests, key=lambda r: r.ids)].count(3) == 5
    ids = [i for r in server.requests for i in r.ids]
    assert len(ids) == len(set(ids)) == GROUPS * N
    assert all(i.startswith("3:0:") and i.endswith(tuple(f":{k}" for k in range(N)))
               for i in ids)
    assert 0 < builtin.metrics["reward_mean"] < 1  # (some right, some wrong: a real check)
    assert served.metrics["reward_retries"] == 0 and served.metrics["reward_errors"] == 0
    assert served.metrics["reward_s"] > 0 and "reward_s" in builtin.metrics
    assert "reward_retries" not in builtin.metrics  # (a service's metrics only)


def test_retries_change_no_reward_and_are_counted(tmp_path: Path) -> None:
    async def graded() -> tuple[Rollout, RewardServer]:
        async with RewardServer(flaky=0.5) as server:
            mgr, _ = manager(tmp_path, remote(server.url, maxRetries=1))
            mgr.grader.scorer.backoff_base_s = 0.001  # type: ignore[union-attr]
            return await mgr.generate(3), server

    served, server = asyncio.run(graded())
    same_batch(served, rollout(manager(tmp_path, {"type": "exact"})[0]))
    busy = sum(r.status == 503 for r in server.requests)
    assert busy > 0 and served.metrics["reward_retries"] == busy
    assert served.metrics["reward_errors"] == 0 and "kept_group_fraction" not in served.metrics


def test_drop_takes_exactly_the_groups_of_a_failed_batch_out_of_the_loss(
        tmp_path: Path) -> None:
    """One prompt's samples always answered 500: every batch holding one fails, and the
    groups with a sample in such a batch (its own and its neighbours') leave the loss; the
    others train as they would have, and the samples without a reward are left out of the
    step's reward (not counted as 0)."""
    manager(tmp_path, {"type": "exact"})  # (writes the data)
    source = PromptSource(tmp_path / "d.jsonl", "prompt", "label", seed=0)
    broken_prompt = source.next_batch(GROUPS)[1].prompt  # the second group's

    async def graded() -> tuple[Rollout, RewardServer]:
        async with RewardServer(broken=lambda i: i["prompt"] == broken_prompt) as server:
            mgr, _ = manager(tmp_path, remote(server.url, maxRetries=1, onError="drop"))
            mgr.grader.scorer.backoff_base_s = 0.001  # type: ignore[union-attr]
            return await mgr.generate(3), server

    served, server = asyncio.run(graded())
    builtin = rollout(manager(tmp_path, {"type": "exact"})[0])
    failed_ids = {i for r in server.requests if r.status == 500 for i in r.ids}
    group = _group_of(tmp_path)
    dropped = sorted({group(i) for i in failed_ids})
    assert dropped == [0, 1, 2]  # its group, and the two its batches share samples with
    kept_rows = torch.tensor([g not in dropped for g in range(GROUPS) for _ in range(N)])
    assert torch.equal(served.batch.loss_mask.sum(dim=1) > 0, kept_rows)
    assert torch.equal(served.batch.loss_mask[kept_rows], builtin.batch.loss_mask[kept_rows])
    m = served.metrics
    assert m["reward_errors"] == len(failed_ids) == 6  # samples 3..8: two batches of 3
    assert m["reward_dropped_groups"] == 3 and m["kept_group_fraction"] == 0.25
    assert m["reward_retries"] == 2  # each failed batch sent twice
    # the step's reward: its samples that have one (as with a failed episode's group, its
    # graded samples count), never a sample without one as 0
    graded = list(server.rewards().values())
    assert len(graded) == GROUPS * N - 6
    assert m["reward_mean"] == pytest.approx(statistics.fmean(graded))


def test_a_step_whose_every_group_is_dropped_is_rolled_out_again_then_fails(
        tmp_path: Path) -> None:
    async def graded() -> None:
        async with RewardServer(broken=lambda i: True, broken_status=503) as server:
            mgr, _ = manager(tmp_path, remote(server.url, maxRetries=0, onError="drop"))
            with pytest.raises(RolloutError) as info:
                await mgr.generate(3)
        assert "reward.onError: drop" in str(info.value)
        assert f"reward.url {server.url}" in str(info.value)
        assert "HTTP 503: grader crashed on" in str(info.value)
        assert len({i for r in server.requests for i in r.ids}) == 3 * GROUPS * N  # 3 steps
    asyncio.run(graded())


def test_fail_ends_the_step_naming_the_url_and_quoting_the_server(tmp_path: Path) -> None:
    async def graded() -> None:
        async with RewardServer(broken=lambda i: True) as server:
            mgr, _ = manager(tmp_path, remote(server.url, maxRetries=1))
            mgr.grader.scorer.backoff_base_s = 0.001  # type: ignore[union-attr]
            with pytest.raises(RewardError) as info:
                await mgr.generate(3)
        assert str(info.value).startswith(f"reward.url {server.url}: a batch of ")
        assert ("failed after 2 attempts (reward.maxRetries 1); the last: HTTP 500: grader "
                "crashed on 3:0:") in str(info.value)
    asyncio.run(graded())


def test_the_services_metrics_are_averaged_over_the_kept_samples(tmp_path: Path) -> None:
    async def graded() -> tuple[Rollout, RewardServer]:
        async with RewardServer(answer="results", metrics=True) as server:
            return await manager(tmp_path, remote(server.url))[0].generate(3), server

    served, server = asyncio.run(graded())
    lengths = [len(i["response"]) for r in server.requests for i in r.items]
    assert len(lengths) == GROUPS * N
    assert served.metrics["reward/length"] == pytest.approx(statistics.fmean(lengths))


def test_metadata_reaches_the_service(tmp_path: Path) -> None:
    async def graded() -> RewardServer:
        async with RewardServer() as server:
            await manager(tmp_path, remote(server.url), metadataKeys=["level"])[0].generate(3)
            return server

    server = asyncio.run(graded())
    items = [i for r in server.requests for i in r.items]
    by_prompt = {r["prompt"]: r["level"] for r in ROWS}
    assert items and all(i["metadata"] == {"level": by_prompt[i["prompt"]]} for i in items)


def test_evaluation_grades_through_the_service_and_leaves_failed_samples_out(
        tmp_path: Path) -> None:
    async def evaluated(**server: Any) -> dict[str, float]:
        async with RewardServer(**server) as s:
            mgr, _ = manager(tmp_path, remote(s.url, maxRetries=0, onError="drop",
                                              batchSize=4))
            return await mgr.evaluate(0)

    builtin = asyncio.run(manager(tmp_path, {"type": "exact"})[0].evaluate(0))
    served = asyncio.run(evaluated())
    # the same scores; no maj@k (the service's answers cannot be compared)
    assert served == {k: v for k, v in builtin.items() if "maj@" not in k}
    assert "eval_add_maj@2" in builtin
    dropping = asyncio.run(evaluated(broken=lambda i: i["label"] == "20"))
    assert dropping["eval_add_reward_errors"] == 4  # the batch of 4 holding 10+10='s two
    assert "eval_add_reward" in dropping


# --- the user's function, in each of its forms ------------------------------------------------

FORMS = '''
import asyncio

def per_sample(response, label):
    return " ".join(response.split()).casefold() == " ".join(label.split()).casefold()

async def per_sample_async(response, label):
    await asyncio.sleep(0)
    return per_sample(response, label)

SEEN = []

def batch(samples):
    SEEN.extend(samples)
    return [per_sample(s.response, s.label) for s in samples]

async def batch_async(samples):
    await asyncio.sleep(0)
    return batch(samples)

def short(samples):
    return [1.0]

def not_finite(response, label):
    return float("nan")

async def raises(response, label):
    raise ValueError("judge down")

def raises_batch(samples):
    raise ValueError("judge down")
'''


@pytest.fixture
def forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "kuberl_test_forms.py").write_text(FORMS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kuberl_test_forms", raising=False)
    import kuberl_test_forms

    return kuberl_test_forms


@pytest.mark.parametrize(("function", "batch"), [
    ("per_sample", False), ("per_sample_async", False), ("batch", True),
    ("batch_async", True)])
def test_every_form_of_a_users_function_makes_the_builtins_batch(
        tmp_path: Path, forms: Any, function: str, batch: bool) -> None:
    """The same TrainBatch (so the same training) as reward.type exact, from a function of
    one sample or of the step's samples, plain or async."""
    reward = {"type": "custom", "function": f"kuberl_test_forms:{function}", "batch": batch}
    mine = rollout(manager(tmp_path, reward, metadataKeys=["level"] if batch else [])[0])
    same_batch(mine, rollout(manager(tmp_path, {"type": "exact"})[0]))
    if batch:  # one call with the step's samples, each with its prompt, label and metadata
        assert len(forms.SEEN) == GROUPS * N
        by_prompt = {r["prompt"]: r for r in ROWS}
        assert all(s.label == by_prompt[s.prompt]["label"]
                   and s.metadata == {"level": by_prompt[s.prompt]["level"]}
                   and s.id.startswith("3:0:") for s in forms.SEEN)


@pytest.mark.parametrize(("function", "batch", "words"), [
    ("short", True, "reward function kuberl_test_forms:short returned 1 rewards for 16 "
     "samples"),
    ("not_finite", False, "reward function kuberl_test_forms:not_finite (sample 3:0:"),
    ("raises", False, "reward function kuberl_test_forms:raises raised on sample 3:0:"),
    ("raises_batch", True, "reward function kuberl_test_forms:raises_batch raised on a batch "
     "of 16 samples: ValueError: judge down"),
])
def test_a_function_that_cannot_grade_fails_the_step_naming_it(
        tmp_path: Path, forms: Any, function: str, batch: bool, words: str) -> None:
    reward = {"type": "custom", "function": f"kuberl_test_forms:{function}", "batch": batch}
    mgr, _ = manager(tmp_path, reward)
    with pytest.raises(RewardError) as info:
        rollout(mgr)
    assert words in str(info.value), str(info.value)
    if function == "not_finite":
        assert "returned nan, not a finite number" in str(info.value)


@pytest.mark.parametrize(("function", "batch", "words"), [
    ("batch", False, "takes (samples); it is called as fn(response, label) (a function of the "
     "step's samples needs reward.batch: true)"),
    ("per_sample", True, "takes (response, label); it is called as fn(samples) with "
     "reward.batch: true"),
])
def test_a_function_of_the_other_form_is_refused_at_load(
        forms: Any, function: str, batch: bool, words: str) -> None:
    with pytest.raises(RewardLoadError) as info:
        load_grader(RewardSpec(type="custom", function=f"kuberl_test_forms:{function}",
                               batch=batch))
    assert f"'kuberl_test_forms:{function}' {words}" in str(info.value), str(info.value)


def _group_of(tmp_path: Path) -> Any:
    """id -> the group of the step its sample is in (the order the manager draws prompts in:
    seed 0)."""
    source = PromptSource(tmp_path / "d.jsonl", "prompt", "label", seed=0)
    order = [s.index for s in source.next_batch(GROUPS)]
    return lambda rid: order.index(int(rid.split(":")[2]))
