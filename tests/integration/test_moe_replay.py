"""Rollout routing replay end to end: a `kuberl run` of a tiny random Qwen3-MoE on the
reference engine, whose routing is perturbed (KUBERL_REFERENCE_PERTURB_ROUTES: each token's
last expert swapped for its next best) so that it routes differently from the trainer holding
the same weights, fp32 on both sides.

With `routingReplay: rollout` the trainer replays the experts the engine returned for every
token, and its log-probs of the sampled tokens are the engine's (the run's own
`rollout_logp_abs_diff_max`, every step, including after a weight sync), while its own router
disagrees with most of those routes (`routing_replay_mismatch`). That the log-probs are far
apart without replay is shown without a second run of its own Ray: in
tests/unit/test_fsdp_moe.py (the backend against HF perturbed the same way) and in
tests/unit/test_reference_moe.py (the engine's log-probs against HF with and without its
returned routes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl_rollout.reference.moe import PERTURB_ENV
from tests.integration.local_run import SHARED_RAY, failed, kuberl_run, manifest, metrics
from tests.integration.tiny_moe import build_tiny_moe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 2


def run(tiny: Path, tmp: Path, moe: Path, replay: str) -> list[dict[str, float]]:
    job = manifest(tiny, tmp, f"moe-{replay}", model={"path": str(moe)},
                   data={"rolloutBatchSize": 4, "nSamplesPerPrompt": 4},
                   algorithm={"routingReplay": replay, "lr": 1e-3},
                   training={"microBatchSize": 16},
                   schedule={"numRollouts": STEPS})
    res = kuberl_run(job, tmp / f"out-{replay}", env={PERTURB_ENV: "1"})
    assert res.returncode == 0, failed(res)
    rows = metrics(tmp / f"out-{replay}")
    assert len(rows) == STEPS
    return rows


def test_rollout_replay_makes_the_trainers_logprobs_the_perturbed_engines(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ray of the run's own: its engines inherit the switch (the shared Ray's do not).
    monkeypatch.delenv(SHARED_RAY, raising=False)
    moe = build_tiny_moe(tmp_path / "moe")
    replayed = run(tiny, tmp_path, moe, "rollout")
    for step in replayed:
        assert step["rollout_logp_abs_diff_max"] < 1e-4, step
        # The engine did route otherwise: the trainer's own router disagrees with most of
        # the (token, MoE layer) routes it replayed.
        assert step["routing_replay_mismatch"] > 0.5, step
