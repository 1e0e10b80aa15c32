"""`kuberl run` end to end on CPU: real Ray, real reference engines behind the SGLang HTTP API,
real weight sync over gloo, checkpoints that resume exactly, and bad input that fails early."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kuberl_rollout.reference import fault
from tests.integration import learning
from tests.integration.local_run import (
    ENV,
    KUBERL,
    example_on_cpu,
    failed,
    kuberl_run,
    manifest,
    metrics,
    session_options,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# The train-inference gap's bounds where trainer and engines hold the same float32 weights
# (docs/algorithms.md, "The train-inference gap").
FP32_GAP_MEAN = 1e-5
FP32_GAP_MAX = 1e-4


def test_colocated_run_learns_and_writes_metrics(tiny: Path, tmp_path: Path) -> None:
    outcome = learning.ALGORITHMS["grpo-colocated"].run(tiny, tmp_path)
    rows = outcome.rows
    assert [r["step"] for r in rows] == list(range(8))
    for key in ("reward_mean", "reward_std", "response_length_mean", "time_generate_s",
                "time_train_s", "time_sync_s", "pg_loss", "entropy", "weight_version"):
        assert all(key in r for r in rows), key
    assert [r["weight_version"] for r in rows] == list(range(1, 9))
    # Every step's sync sent the whole model (the same bytes), counted into the running total.
    assert len({r["weight_sync_bytes"] for r in rows}) == 1 and rows[0]["weight_sync_bytes"] > 0
    totals = [r["weight_sync_bytes_total"] for r in rows]
    assert [b - a for a, b in itertools.pairwise(totals)] == [
        r["weight_sync_bytes"] for r in rows[1:]]
    # The train-inference gap: the engines serve the trainer's own float32 weights on CPU, so
    # their log-probs of the sampled tokens differ from the trainer's by float noise only
    # (measured: mean |diff| ~3e-7, max ~8e-6; docs/algorithms.md). One optimizer step per
    # rollout: no forward pass of the trainer's for pi_old.
    for r in rows:
        assert r["rollout_logp_abs_diff_mean"] < FP32_GAP_MEAN, r
        assert r["rollout_logp_abs_diff_max"] < FP32_GAP_MAX, r
        assert abs(r["rollout_seq_log_ratio_max"]) < FP32_GAP_MAX, r
        assert abs(r["rollout_seq_log_ratio_min"]) < FP32_GAP_MAX, r
        assert r["old_logprobs_recomputed"] == 0.0, r
    failures = learning.ALGORITHMS["grpo-colocated"].failures(outcome)
    assert not failures, failures
    assert "step  reward" in outcome.stdout  # the per-step table a person watches
    # saved every 3 steps and at the end; checkpoint.keep (2) pruned step_3
    assert sorted(p.name for p in (outcome.out / "checkpoints").iterdir()) == [
        "step_6", "step_8"]


# (Two disaggregated engines of one process each, and of two processes each on one node:
# the fault tests, dies-tp1 and dies-tp2, check every engine process's weights after every
# sync in those layouts.)
ENGINE_LAYOUTS = {
    # examples/colocated-single-node.yaml as a CPU runs it (local_run.example_on_cpu): TP 2
    # reference engines sharing the trainer's devices, its offload and memoryFraction as set.
    "colocated-single-node-example": ("colocate", "colocated-single-node.yaml"),
    # Engines wider than a node: each engine's two processes on two "nodes" (actors), node 1's
    # rank joining the group from there (SGLang's --nnodes 2).
    "disaggregated-tp2-over-2-nodes": ("disaggregated", {"gpus": 0, "engines": 2,
                                                         "gpusPerEngine": 2, "gpusPerNode": 1}),
}


def test_async_one_step_off_learns_on_samples_one_version_old(tiny: Path,
                                                             tmp_path: Path) -> None:
    """mode async: every step after the first trains on a rollout the engines generated
    under the previous weights (as they report them) while the step before trained; the
    bound (maxStaleness 1) holds in every step, and the job learns as a sync one does."""
    scenario = learning.ASYNC_ONE_STEP_OFF
    outcome = scenario.run(tiny, tmp_path)
    rows = outcome.rows
    assert [r["step"] for r in rows] == list(range(8))
    assert [r["weight_version"] for r in rows] == list(range(1, 9))
    assert [(r["staleness_mean"], r["staleness_max"]) for r in rows] == (
        [(0.0, 0.0)] + [(1.0, 1.0)] * 7)
    assert all(r["dropped_stale_samples"] == 0 for r in rows)
    for r in rows:  # the overlap's accounting adds up
        assert r["time_wait_rollout_s"] >= 0 and r["time_wait_train_s"] >= 0
        assert 0 <= r["overlap_fraction"] <= 1 and r["overlap_efficiency"] > 0
        assert r["time_step_s"] >= r["time_train_s"] + r["time_sync_s"]
    assert len({r["weight_sync_bytes"] for r in rows}) == 1 and rows[0]["weight_sync_bytes"] > 0
    assert rows[-1]["overlap_fraction"] == 0  # nothing left to generate beside the last step
    failures = scenario.failures(outcome)
    assert not failures, failures


@pytest.mark.parametrize("partial", [False, True], ids=["whole-rollouts", "partial-rollouts"])
def test_fully_async_learns_within_the_staleness_bound(tiny: Path, tmp_path: Path,
                                                        partial: bool) -> None:
    """maxStaleness 4 on the demo's task (addition, exact reward), with the defaults: the
    engines run ahead of the trainers only as far as keeps them fed (async.runAhead
    adaptive), never so far that a sample's oldest token lags the policy training on it by
    more than 4 versions; the default off-policy correction (TIS at 2) weights every step;
    and the job learns (learning.ASYNC_MIN_EXACT_GAIN; over 16 runs it kept 93% of sync's
    gain, bench/async_correction.py; uncorrected and always 4 ahead it lost reward at every
    seed measured)."""
    scenario = learning.ASYNC_STALENESS_4[partial]
    outcome = scenario.run(tiny, tmp_path)
    rows = outcome.rows
    assert [r["step"] for r in rows] == list(range(learning.ADDITION_STEPS))
    assert all(0 <= r["staleness_max"] <= 4 for r in rows), [r["staleness_max"] for r in rows]
    assert all(1 <= r["run_ahead_depth"] <= 4 for r in rows)
    # where generating is quicker than training (this job on CPU), running ahead buys nothing:
    # the samples stay fresher than the bound (runAhead bound: 3.9 versions on average)
    if (statistics.fmean(r["time_generate_s"] for r in rows[1:])
            < statistics.fmean(r["time_train_s"] for r in rows[1:])):
        assert statistics.fmean(r["staleness_mean"] for r in rows) < 3
    assert all(r["dropped_stale_samples"] == 0 for r in rows)
    assert all(0 <= r["partial_rollout_fraction"] <= (1 if partial else 0) for r in rows)
    # the correction is on without being asked for: TIS's weights are in every step
    assert all(0 < r["tis_weight_mean"] <= 2 for r in rows)
    assert any(r["rollout_logp_abs_diff_mean"] > 1e-3 for r in rows)  # stale samples
    failures = scenario.failures(outcome)
    assert not failures, failures


def test_partial_rollouts_finish_under_the_weights_sent_mid_rollout(tiny: Path,
                                                                    tmp_path: Path) -> None:
    """Generation slower than training (an engine decoding one request at a time), one-step
    off. With partialRollout the update goes out while the next rollout is in flight: the
    engines pause it, take the new weights and finish it, and those responses report the new
    version. Without it the update waits for the rollout, and no response spans two versions.
    The bound holds either way, and staleness counts the oldest token (the submitted version)."""
    rows = {}
    for partial in (False, True):
        spec = {"placement": "disaggregated", "mode": "async",
                "rollout": {"gpus": 0, "engineArgs": {"max-batch-size": "1"}},
                "async": {"maxStaleness": 1, "partialRollout": partial},
                "schedule": {"numRollouts": 3}}
        name = f"partial-{partial}".lower()
        res = kuberl_run(manifest(tiny, tmp_path, name, **spec), tmp_path / name)
        assert res.returncode == 0, failed(res)
        rows[partial] = metrics(tmp_path / name)
    for partial, steps in rows.items():
        print(f"partialRollout {partial}: " + ", ".join(  # (-rP: the margins on this machine)
            f"step {r['step']} generate {r['time_generate_s']:.2f} s train "
            f"{r['time_train_s']:.2f} s spanned {r['partial_rollout_fraction']:.2f}"
            for r in steps))
        assert [r["staleness_max"] for r in steps] == [0.0, 1.0, 1.0], partial
        assert all(r["dropped_stale_samples"] == 0 for r in steps)
        # slower generation than training: the trainers waited for rollouts
        assert statistics.fmean(r["time_generate_s"] for r in steps[1:]) > statistics.fmean(
            r["time_train_s"] for r in steps[1:])
    assert all(r["partial_rollout_fraction"] == 0 for r in rows[False])
    assert rows[True][0]["partial_rollout_fraction"] == 0  # nothing trained yet to send
    spanned = [r["partial_rollout_fraction"] for r in rows[True][1:]]
    assert all(0 < f <= 1 for f in spanned), spanned


@pytest.mark.parametrize("bound", [{"maxStaleness": 1},
                                   {"maxStaleness": 4, "partialRollout": True,
                                    "runAhead": "bound"}],
                         ids=["one-step-off", "staleness-4-partial"])
def test_async_resume_draws_the_prompts_of_the_rollouts_it_did_not_train(
        tiny: Path, tmp_path: Path, bound: dict[str, Any]) -> None:
    """A checkpoint written after step 3 of an async run, when the rollouts of the next
    steps (their prompts drawn, generated) already existed: it holds none of them, and a run
    resumed from it draws those prompts again (the same as the uninterrupted run trained on),
    generates them under the restored weights, and never trains on a sample older than the
    bound."""

    spec = {"placement": "disaggregated", "rollout": {"gpus": 0}, "mode": "async",
            "async": bound, "schedule": {"numRollouts": 6, "saveInterval": 3}}
    whole = manifest(tiny, tmp_path, "whole", **spec)
    assert kuberl_run(whole, tmp_path / "a").returncode == 0
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_3",
                    tmp_path / "b" / "checkpoints" / "step_3")
    res = kuberl_run(manifest(tiny, tmp_path, "resumed", **spec), tmp_path / "b")
    assert res.returncode == 0, failed(res)
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [3, 4, 5]
    assert [r["prompts_sha"] for r in b] == [r["prompts_sha"] for r in a[3:]]
    # the first regenerated under the restored weights (version 3): fresher than the bound
    assert b[0]["staleness_max"] == 0.0
    assert all(r["staleness_max"] <= bound["maxStaleness"] for r in a + b)
    if bound["maxStaleness"] == 1:
        assert [r["staleness_max"] for r in b] == [0.0, 1.0, 1.0]
    elif (statistics.fmean(r["time_generate_s"] for r in a[1:])
            < statistics.fmean(r["time_train_s"] for r in a[1:])):
        # runAhead bound, generating quicker than training: the engines ran past one ahead
        assert max(r["staleness_max"] for r in a) > 1, [r["staleness_max"] for r in a]
        assert all(r["run_ahead_depth"] == 4 for r in a + b)


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_every_engine_process_holds_the_trainers_weights_after_every_step(
        tiny: Path, tmp_path: Path, layout: str) -> None:
    """After each step's sync, every TP process of every engine holds exactly the trainer's
    weights (checked from inside the loop, after each push)."""
    import json
    import urllib.request

    from kuberl_api import load
    from kuberl_trainer.preflight import check
    from kuberl_trainer.report.progress import Progress
    from kuberl_trainer.session import Session

    placement, rollout = ENGINE_LAYOUTS[layout]
    job = load(example_on_cpu(tiny, tmp_path, rollout) if isinstance(rollout, str) else
               manifest(tiny, tmp_path, "sync", placement=placement, rollout=rollout,
                        schedule={"numRollouts": 2}))
    opts = session_options(tmp_path)
    session = Session(job, opts, check(job.spec))
    tp = job.spec.rollout.gpus_per_engine
    synced: list[int] = []
    try:
        session.start()
        assert session.engines is not None and session.trainers is not None
        trainers, urls = session.trainers, session.engines.urls
        push = trainers.push_weights

        def check(engine_urls: list[str], version: int) -> None:
            want = trainers.checksums()
            for url in engine_urls:
                with urllib.request.urlopen(f"{url}/get_weights_checksum?all_ranks=true",
                                            timeout=60) as answer:
                    ranks = json.loads(answer.read())["tp_ranks"]
                assert len(ranks) == tp, (url, len(ranks))
                for rank, sums in enumerate(ranks):
                    assert {k: sums[k] for k in want} == want, (url, rank, version)

        # Colocated engines released their weights at start (discarded, as SGLang's are):
        # the start-up sync gave them back.
        check(urls, 0)

        def push_and_check(engine_urls: list[str], version: int, bucket_bytes: int) -> float:
            seconds = push(engine_urls, version, bucket_bytes)
            check(engine_urls, version)
            synced.append(version)
            return seconds

        trainers.push_weights = push_and_check  # type: ignore[method-assign]
        session.train(Progress(2))
        for url in urls:  # the memory handoff, as each engine recorded what it was asked
            with urllib.request.urlopen(f"{url}/get_event_log", timeout=60) as answer:
                events = json.loads(answer.read())["events"]
            evals = (job.spec.schedule.eval_interval or 0) if job.spec.data.eval_sets else 0
            saves = job.spec.schedule.save_interval or 0
            assert handoff_sequence(events) == expected_handoff(placement, 2, evals, saves), url
        assert len(urls) == job.spec.num_engines
        assert [len(parts) for parts in session.engines.parts] == (
            [job.spec.engine_nodes] * len(urls))
        assert synced == [1, 2]
        last = metrics(tmp_path / "out")[-1]
        assert last["weight_version"] == 2
        handoff = {"time_offload_s", "time_onload_s", "offload_gib"}
        if placement == "colocate":  # (on CPU the trainers free nothing: offload_gib 0)
            assert handoff <= set(last) and last["time_offload_s"] > 0
        else:
            assert not handoff & set(last)
    finally:
        session.close()


# Each faulted run: the fault as the weights of version 1 go out (or, -in-sync, as those of
# version 2 do), then two more syncs, each of which the replacement must get.
FAULT_STEPS = 3
VERSIONS = list(range(1, FAULT_STEPS + 1))
FAULTS = [("dies", 1, "sync"), ("dies", 2, "sync"), ("hangs", 1, "sync"), ("dies", 1, "async"),
          ("dies-in-sync", 1, "sync"), ("hangs-in-sync", 1, "sync"),
          ("dies-mid-broadcast", 2, "sync"), ("dies-alone", 1, "sync"),
          ("dies-alone", 1, "async"), ("pod-lost", 1, "sync")]
BETWEEN_STEPS = ("dies", "hangs", "dies-alone", "pod-lost")  # faults at version 1's end
FAULT_SIGNAL = fault.SIGNAL  # the reference engine's fault switch


def engine_pids(url: str) -> list[int]:
    """The reference engine processes started for `url` (after its fault switch: the child
    holding its connections)."""
    port = url.rsplit(":", 1)[1]
    return [int(p) for p in subprocess.run(
        ["pgrep", "-f", f"kuberl_rollout.reference .*--port {port}( |$)"],
        capture_output=True, text=True).stdout.split()]
# The same behind SGLang's router (rollout.router: sglang); the async loop reaches the router
# through the same client and fleet calls (a routed async run passed; left out for the tier's
# time)
ROUTED_FAULTS = [("dies", 1, "sync"), ("hangs", 1, "sync"), ("dies-alone", 1, "sync")]


@pytest.mark.parametrize(("fault", "tp", "mode", "router"),
                         [(*f, "none") for f in FAULTS] + [(*f, "sglang") for f in ROUTED_FAULTS],
                         ids=[f"{f}-tp{t}-{m}" for f, t, m in FAULTS]
                         + [f"{f}-tp{t}-{m}-router" for f, t, m in ROUTED_FAULTS])
def test_a_dead_or_hung_engine_is_replaced_and_the_run_goes_on(
        tiny: Path, tmp_path: Path, fault: str, tp: int, mode: str, router: str,
        shared_run: Callable[[str, Path], Path]) -> None:
    """An engine SIGKILLed (dies) or SIGSTOPped (hangs: alive, silent) between steps: the next
    rollout's requests it holds go to the other engine (once the health probe has found it
    silent, for a hung one), it is replaced before the weights go out, and the replacement
    holds the trainer's weights after that sync and every later one. Every step trains on the
    very samples an undisturbed run draws (same prompts, same rewards): none lost, none
    twice. (async: one-step-off, the engine killed as the rollout it would share begins.
    dies-in-sync: killed as the weights of step 1 go out; the sync is made again, to the
    replacement and the engine that got them the first time. hangs-in-sync: stopped there
    instead; past the sync's deadline it is taken for hung and replaced the same way.
    dies-mid-broadcast: the reference engine's fault switch (kuberl_rollout/reference/fault.py)
    kills it as the first bucket of version 2 is announced, the broadcast in flight, its
    weight-sync connections left open and silent as a vanished node's: engine 1's first rank,
    which gloo has take that bucket from engine 0's, is left in the receive; the trainer aborts
    the group and tells engine 1 to leave it, so engine 1 is kept, only engine 0 is replaced,
    and the next step starts well within the group's 300 s timeout.
    dies-alone: the only engine,
    killed between steps: the next rollout waits while it is replaced and given the weights
    the trainers hold, then goes on on the replacement. pod-lost: the engine's Ray actor
    dies with its server, as when its pod goes: a new actor takes its placement bundle.
    router: generation through SGLang's router, which the fleet keeps to the engines in
    rotation: a hung engine is taken out of it and killed, and the router sends what it held
    there to the other engine.)"""
    import json
    import urllib.request

    from kuberl_api import load
    from kuberl_trainer.preflight import check
    from kuberl_trainer.report.progress import Progress
    from kuberl_trainer.session import Session

    def job(name: str) -> Path:
        probe = {"periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": 2}
        return manifest(tiny, tmp_path, name, placement="disaggregated", mode=mode,
                        rollout={"gpus": 0, "engines": 1 if fault == "dies-alone" else 2,
                                 "gpusPerEngine": tp,
                                 "healthProbe": probe, "router": router},
                        schedule={"numRollouts": FAULT_STEPS})

    # (the router changes which engine serves a request, never its samples: test_router.py)
    calm = metrics(shared_run(f"undisturbed-{mode}-tp{tp}-"
                              f"{1 if fault == 'dies-alone' else 2}-engines", job("undisturbed")))
    spec = load(job("replaced"))
    opts = session_options(tmp_path)
    session = Session(spec, opts, check(spec.spec))
    synced: list[tuple[int, list[str]]] = []
    mid_broadcast: dict[str, float] = {}  # dies-mid-broadcast: when armed, when whole again
    first: list[str] = []
    try:
        session.start()
        assert session.engines is not None and session.trainers is not None
        trainers, first = session.trainers, list(session.engines.urls)
        push = trainers.push_weights

        def kill(url: str, sig: int) -> None:
            port = url.rsplit(":", 1)[1]
            pids = subprocess.run(["pgrep", "-f", f"kuberl_rollout.reference .*--port {port}"],
                                  capture_output=True, text=True).stdout.split()
            assert len(pids) == 1, pids
            if fault == "pod-lost":  # its actor (the server's parent) first, then the server
                actor = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
                assert "EngineServer" in Path(f"/proc/{actor}/cmdline").read_text(), actor
                os.kill(actor, signal.SIGKILL)
            os.kill(int(pids[0]), sig)

        def push_and_check(engine_urls: list[str], version: int, bucket_bytes: int) -> float:
            if fault.endswith("-in-sync") and version == 2 and engine_urls == first:
                kill(first[0], signal.SIGSTOP if fault.startswith("hangs") else signal.SIGKILL)
            if fault == "dies-mid-broadcast" and version == 2 and engine_urls == first:
                kill(first[0], FAULT_SIGNAL)  # (armed: it dies at this sync's first bucket)
                mid_broadcast["armed"] = time.monotonic()
            seconds = push(engine_urls, version, bucket_bytes)
            if fault == "dies-mid-broadcast" and version == 2:  # (made again, whole)
                mid_broadcast["whole"] = time.monotonic()
                events = json.loads(urllib.request.urlopen(
                    f"{first[1]}/get_event_log", timeout=60).read())["events"]
                assert "abort_group" in [e["op"] for e in events]  # (told to leave)
            want = trainers.checksums()
            for url in engine_urls:
                with urllib.request.urlopen(f"{url}/get_weights_checksum?all_ranks=true",
                                            timeout=60) as answer:
                    ranks = json.loads(answer.read())["tp_ranks"]
                assert len(ranks) == tp
                assert all({k: sums[k] for k in want} == want for sums in ranks), (url, version)
            synced.append((version, list(engine_urls)))
            if version == 1 and engine_urls == first and fault in BETWEEN_STEPS:
                kill(first[0], signal.SIGSTOP if fault == "hangs" else signal.SIGKILL)
            return seconds

        trainers.push_weights = push_and_check  # type: ignore[method-assign]
        session.train(Progress(FAULT_STEPS))
    finally:
        session.close()
        if mid_broadcast:  # the fault switch's child, still holding engine 0's connections
            for pid in engine_pids(first[0]):
                os.kill(pid, signal.SIGKILL)
    if fault == "dies-mid-broadcast":
        took = mid_broadcast["whole"] - mid_broadcast["armed"]
        print(f"dies-mid-broadcast: the weights of version 2 were whole on every engine "
              f"{took:.1f} s after the sync that killed engine 0 began (group timeout 300 s)")
        assert took < 60, took
    rows = metrics(tmp_path / "out")
    assert [r["engine_restarts_total"] for r in rows] == [0] + [1] * (FAULT_STEPS - 1)
    if fault == "dies-alone":
        # The replacement got the trainers' weights before it generated: those of the last
        # sync (mode sync), or of the step the trainers had taken meanwhile (async).
        assert synced[0] == (1, first) and synced[1][0] in (1, 2)
        assert [v for v, _ in synced[1:]] == sorted(v for v, _ in synced[1:])
        assert {v for v, _ in synced} == set(VERSIONS) and len(synced) == FAULT_STEPS + 1
        assert all(urls == synced[1][1] != first for _, urls in synced[1:])
        same = ("prompts_sha", "reward_mean", "response_length_mean") if mode == "sync" else (
            "prompts_sha",)  # (async: a rollout partly made under newer weights)
        for key in same:
            assert [r[key] for r in rows] == [r[key] for r in calm], key
        return
    assert [v for v, _ in synced] == VERSIONS
    assert synced[0][1] == first
    replaced = synced[1][1]
    assert replaced[0] != first[0] and replaced[1] == first[1]
    assert all(urls == replaced for _, urls in synced[1:])
    for key in ("prompts_sha", "reward_mean", "response_length_mean"):
        assert [r[key] for r in rows] == [r[key] for r in calm], key


def handoff_sequence(events: list[dict[str, Any]]) -> list[str]:
    """An engine's generation, memory and weight-update operations, in order, a run of the same
    one written once ("update": a sync's buckets, either path)."""
    out: list[str] = []
    for e in events:
        op = e["op"]
        if op.startswith("update_from_"):
            op = "update"
        elif op.endswith("_memory"):
            op = f"{op}:{','.join(e['tags'] or ['all'])}"
        elif op not in ("generate", "generate_refused"):
            continue
        if not out or out[-1] != op:
            out.append(op)
    return out


def expected_handoff(placement: str, steps: int, evals: int = 0, saves: int = 0) -> list[str]:
    """Colocated: at start, release everything for the trainers to build in, then the
    start-up sync; after generating, release everything; the weights' memory back before the
    update, the KV cache and graphs after it; the evaluation (every `evals` steps) generates
    after the step's sync; at the end, unless the last step saved (every `saves` steps, right
    after training), release everything for the last save; never a generation while
    released (it would be refused: generate_refused). Disaggregated engines keep their
    GPUs; their start-up sync is one bucket (the group's check)."""
    sync = (["update"] if placement != "colocate" else
            ["resume_memory:weights", "update", "resume_memory:kv_cache,cuda_graph"])
    # (disaggregated, the start-up sync checks the group with one bucket)
    ops = ["update"] if placement != "colocate" else ["release_memory:all", *sync]
    for step in range(1, steps + 1):
        ops += ["generate", *([] if placement != "colocate" else ["release_memory:all"]), *sync]
        ops += ["generate"] if evals and step % evals == 0 else []
    if placement == "colocate" and not (saves and steps % saves == 0):
        ops.append("release_memory:all")  # the run's last save: the trainers' whole state back
    return [op for i, op in enumerate(ops) if i == 0 or ops[i - 1] != op]


RESUMABLE = {
    "grpo": ({}, ("reward_mean", "response_length_mean", "pg_loss", "entropy")),
    # PPO: the critic's weights, optimizer and RNG resume too, or values and advantages drift
    "ppo": ({"algorithm": {"advantageEstimator": "ppo"}, "critic": {"lr": 1e-3}},
            ("reward_mean", "pg_loss", "value_loss", "explained_variance", "advantage_mean")),
    # LoRA: the base from model.path and the checkpoint's adapter/ (with its optimizer state)
    "lora": ({"training": {"lora": {"rank": 8}}},
             ("reward_mean", "response_length_mean", "pg_loss", "entropy", "lora_adapter_norm")),
}


# What the actors write (engine INFO lines, HF progress bars, Ray's colours and warnings) and
# must not reach the terminal of a local run: it goes to <output-dir>/logs/.
NOISE = ("\x1b[", "Loading weights", "Writing model shards", "FutureWarning", "updated ",
         " INFO ", "pid=")
# What Ray's raylet says about the machine itself (its disk over 95% full, as on a shared CI
# box): the machine's state, which a user should see on any run, not the run's own output.
MACHINE_WARNINGS = ("file_system_monitor.cc",)


def assert_terminal_is_clean(res: subprocess.CompletedProcess[str], out: Path,
                             roles: tuple[str, ...], runs: int = 1) -> None:
    """The terminal of a finished local run: where the logs are, the step table and the
    summary, nothing else; the actors' routine output is in their log files (appended to by
    each of `runs` runs into `out`)."""
    terminal = res.stdout + res.stderr
    assert res.stdout.startswith(f"logs: {out / 'logs'}/ "), res.stdout[:300]
    assert "step  reward" in res.stdout and "reward: first-" in res.stdout
    for noise in NOISE:
        assert noise not in terminal, (noise, terminal[-3000:])
    own = [line for line in res.stderr.splitlines()
           if not any(warning in line for warning in MACHINE_WARNINGS)]
    assert own == [], res.stderr[-3000:]
    engine = (out / "logs" / "engine-0.log").read_text()
    assert "updated " in engine and "weight_version" in engine
    assert engine.count("==== ") == runs  # one header per run: reruns append, never truncate
    for role in roles:
        assert "rank 0/1 on cpu" in (out / "logs" / f"{role}-0.log").read_text(), role


def whole_run(tiny: Path, tmp_path: Path, shared_run: Callable[[str, Path], Path],
              name: str) -> Path:
    """The uninterrupted 6-step run the resume tests compare with (saving every 3 steps,
    which changes nothing it trains: the resumed runs' first half saves or stops there)."""
    extra, _ = RESUMABLE[name]
    return shared_run(f"whole-{name}", manifest(
        tiny, tmp_path, "whole", schedule={"numRollouts": 6, "saveInterval": 3}, **extra))


@pytest.mark.parametrize("name", RESUMABLE)
def test_resume_replays_the_uninterrupted_run(tiny: Path, tmp_path: Path, name: str,
                                              shared_run: Callable[[str, Path], Path]) -> None:
    """A run resumed from the uninterrupted run's checkpoint after step 3 (its own output
    folder holding just that) trains exactly what the uninterrupted run trained after it. (A
    run resumed into its own folder, appending to its metrics and logs: the SIGTERM test.)"""
    extra, keys = RESUMABLE[name]
    whole = whole_run(tiny, tmp_path, shared_run, name)
    out = tmp_path / "b"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
    rest = manifest(tiny, tmp_path, "whole", schedule={"numRollouts": 6, "saveInterval": 3},
                    **extra)
    res = kuberl_run(rest, out)
    assert res.returncode == 0, failed(res)
    # A resumed run loads and saves checkpoints: the terminal still shows only the table.
    assert_terminal_is_clean(res, out, roles=("train", "critic") if name == "ppo" else ("train",))
    a, b = metrics(whole), metrics(out)
    assert [r["step"] for r in b] == [3, 4, 5]
    for ra, rb in zip(a[3:], b, strict=True):
        assert ra["prompts_sha"] == rb["prompts_sha"]
        for key in keys:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-5), key


def test_sigterm_saves_at_a_safe_point_and_the_resumed_run_replays_the_whole_one(
        tiny: Path, tmp_path: Path, shared_run: Callable[[str, Path], Path]) -> None:
    """What a preempted head does (its preStop hook sends the driver SIGTERM): stop where the
    state is consistent (a rollout in flight is dropped, a step in training finishes), save,
    exit 143 (never 0: a stop must not read as success); the next run resumes there and trains
    exactly what the uninterrupted run trained."""
    from kuberl_trainer.checkpoint import latest

    whole = whole_run(tiny, tmp_path, shared_run, "grpo")
    spec = {"schedule": {"numRollouts": 6}}  # no saveInterval: the stop's save is the only one
    job, out = manifest(tiny, tmp_path, "stopped", **spec), tmp_path / "b"
    proc = subprocess.Popen([*KUBERL, "run", str(job), "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=job.parent, env=ENV)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    assert "stopping (SIGTERM): saving a checkpoint" in stderr
    trained = len(metrics(out))
    saved = latest(out / "checkpoints")
    assert saved is not None and saved[0] == trained < 6, (saved, trained)
    res = kuberl_run(job, out)
    assert res.returncode == 0, failed(res)
    # The resumed run appended to the stopped one's metrics and logs, its terminal clean.
    assert_terminal_is_clean(res, out, roles=("train",), runs=2)
    a, b = metrics(whole), metrics(out)
    assert [r["step"] for r in b] == list(range(6))
    for ra, rb in zip(a[trained:], b[trained:], strict=True):
        assert ra["prompts_sha"] == rb["prompts_sha"]
        for key in ("reward_mean", "pg_loss", "entropy"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize(("edit", "expect"), [
    (lambda t: {"data": {"prompts": str(t / "missing.jsonl")}}, "spec.data.prompts"),
    (lambda t: {"data": {"inputKey": "question"}}, "question"),
    (lambda t: {"model": {"path": str(t / "data")}}, "spec.model.path"),
    (lambda t: {"reward": {"type": "custom", "function": "no_such_module:score"}},
     "no_such_module"),
    # a function of one sample where reward.batch says the step's samples
    (lambda t: {"reward": {"type": "custom", "batch": True,
                           "function": "tests.integration.toy_rewards:leading_one"}},
     "leading_one' takes (response: str, label: str) -> float; it is called as fn(samples) "
     "with reward.batch: true"),
    (lambda t: {"suspend": True}, "spec.suspend"),  # held, as the operator would hold it
    # a LoRA target the model does not have (preflight.check_lora, on the meta device)
    (lambda t: {"training": {"lora": {"rank": 8, "targetModules": ["qkv_proj"]}}},
     "spec.training.lora.targetModules: 'qkv_proj' names no module"),
])
def test_bad_input_fails_before_ray_starts(tiny: Path, tmp_path: Path, edit: Any,
                                           expect: str) -> None:
    job = manifest(tiny, tmp_path, "bad", **edit(tiny))
    started = time.monotonic()
    res = kuberl_run(job, tmp_path / "out", timeout=120)
    assert res.returncode == 1
    assert expect in res.stderr
    assert "Ray" not in res.stderr and time.monotonic() - started < 60


def test_engine_that_cannot_start_fails_the_run_at_once(tiny: Path, tmp_path: Path) -> None:
    """An engine server that exits while starting (here: a flag value it refuses) ends the
    run with its exit code and its log's last lines, not after the 600 s start timeout."""
    job = manifest(tiny, tmp_path, "nostart", rollout={"engineArgs": {"max-batch-size": "lots"}})
    started = time.monotonic()
    res = kuberl_run(job, tmp_path / "out", timeout=300)
    assert res.returncode == 1
    assert "exited with code 2" in res.stderr, res.stderr[-3000:]
    assert "invalid int value: 'lots'" in res.stderr  # argparse's words, from the engine log
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_death_past_the_restart_budget_fails_the_run_with_its_error(
        tiny: Path, tmp_path: Path, mode: str) -> None:
    """(async: the engine dies while it generates beside a training step)"""
    job = manifest(tiny, tmp_path, "dies", placement="disaggregated", mode=mode,
                   rollout={"gpus": 0, "engines": 2, "maxEngineRestarts": 0},
                   schedule={"numRollouts": 200})
    out = tmp_path / "out"
    proc = subprocess.Popen([*KUBERL, "run", str(job), "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not metrics(out):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.5)
        engines = [pid for pid in subprocess.run(
            ["pgrep", "-f", f"kuberl_rollout.reference --model-path {tiny}"],
            capture_output=True, text=True).stdout.split() if descends(int(pid), proc.pid)]
        assert engines  # this run's (its local Ray is the driver's child), not another test's
        os.kill(int(engines[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "engine" in err and "error:" in err
    assert "rollout.maxEngineRestarts is 0" in err, err[-3000:]
    # The error names the dead engine's log file and quotes its end (the log itself stays off
    # the terminal until then).
    assert f"{out / 'logs'}/engine-" in err and "weight_version" in err, err[-3000:]
    assert "\x1b[" not in err


def descends(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is `ancestor` or one of its descendants (Linux /proc)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False
