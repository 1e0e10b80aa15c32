"""training.lora in a local run: what the engines generate from is the trained adapter.

LoRA's silent failure is an adapter that never reaches the engines: rollouts keep coming
from the base model while the run looks healthy (loss, grad norm and the adapter's norm all
move). The check here is on the engines themselves: after the run, every engine holds the
trainer's merged weights, and those differ from the base in every targeted weight (and only
there). `KUBERL_TEST_LORA_UNMERGED` (backends/lora.py) makes the backend send the base weights
instead; the same check must then fail, which the second test shows.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kuberl_wire.protocol import ENGINE_API_KEY_ENV
from tests.integration.local_run import manifest, metrics, session_options

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 2


def lora_run(tiny: Path, tmp_path: Path, *, own_ray: bool = False,
             placement: dict[str, Any] | None = None
             ) -> tuple[dict[str, str], list[dict[str, str]]]:
    """A 2-step tiny job with a rank-8 adapter, driven in this process; the trainer's
    checksums of what it sends and each engine's checksums, after the last step's sync."""
    import dataclasses

    from kuberl_api import load
    from kuberl_trainer.engines.client import engine_api_key
    from kuberl_trainer.preflight import check
    from kuberl_trainer.report.progress import Progress
    from kuberl_trainer.session import Session

    job = load(manifest(tiny, tmp_path, "lora", training={"lora": {"rank": 8}},
                        algorithm={"lr": 5e-3, "klCoef": 0.01},
                        schedule={"numRollouts": STEPS}, **(placement or {})))
    opts = session_options(tmp_path)
    if own_ray:  # (a Ray started here: its actors inherit this process's environment)
        opts = dataclasses.replace(opts, address=None)
    session = Session(job, opts, check(job.spec))
    synced: list[tuple[dict[str, str], list[dict[str, str]]]] = []
    try:
        session.start()
        assert session.trainers is not None and session.engines is not None
        trainers, urls = session.trainers, session.engines.urls
        push = trainers.push_weights

        def push_and_read(engine_urls: list[str], version: int, bucket_bytes: int) -> float:
            # (read right after each sync: colocated engines release their weights later)
            seconds = push(engine_urls, version, bucket_bytes)
            engines = []
            for url in urls:
                ask = urllib.request.Request(f"{url}/get_weights_checksum", headers={
                    "Authorization": f"Bearer {engine_api_key()}"})
                with urllib.request.urlopen(ask, timeout=60) as answer:
                    engines.append(json.loads(answer.read()))
            synced.append((trainers.checksums(), engines))
            return seconds

        trainers.push_weights = push_and_read  # type: ignore[method-assign]
        session.train(Progress(STEPS))
    finally:
        session.close()
    assert len(synced) == STEPS
    return synced[-1]


def base_checksums(tiny: Path) -> dict[str, str]:
    """The base model's weights as the reference engine holds them (float32)."""
    from kuberl_wire.codec import tensor_sha256

    state = load_file(str(tiny / "model" / "model.safetensors"))
    return {name: tensor_sha256(t.to(torch.float32)) for name, t in state.items()}


def assert_adapter_reached_engines(want: dict[str, str], engines: list[dict[str, str]],
                                   base: dict[str, str]) -> None:
    """Every engine holds the trainer's weights, and they are the base moved by the adapter:
    every targeted weight (all linear layers of the decoder) differs from the base, every
    other one is the base's."""
    assert engines
    for sums in engines:
        assert {k: sums[k] for k in want} == want
    targeted = {name for name in base if name.endswith("_proj.weight")}
    assert targeted
    moved = {name for name in want if want[name] != base[name]}
    assert moved == targeted, sorted(targeted - moved)[:5]


# colocated (weights handed over in memory) and disaggregated (broadcast to the engines)
PLACEMENTS = {"colocate": {}, "disaggregated": {"placement": "disaggregated",
                                                "rollout": {"gpus": 0}}}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_engines_generate_from_the_trained_adapter(tiny: Path, tmp_path: Path,
                                                       placement: str) -> None:
    want, engines = lora_run(tiny, tmp_path, placement=PLACEMENTS[placement])
    assert_adapter_reached_engines(want, engines, base_checksums(tiny))
    rows = metrics(tmp_path / "out")
    assert len(rows) == STEPS
    assert all(r["lora_trainable_params"] > 0 for r in rows)
    assert 0 < rows[0]["lora_adapter_norm"] < rows[-1]["lora_adapter_norm"]
    # the full merged weights still go out every step (sync: merged)
    assert all(r["weight_sync_bytes"] > 0 for r in rows)


def test_an_adapter_that_never_reaches_the_engines_fails_the_check(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the backend sends the base weights (the adapter dropped from
    the export), training otherwise the same; the engines then serve the base, which the
    check above catches."""
    monkeypatch.setenv("KUBERL_TEST_LORA_UNMERGED", "1")
    # (the run's own Ray makes the engines' API key: set here, so that it goes with the test)
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "lora-negative-control")
    want, engines = lora_run(tiny, tmp_path, own_ray=True)
    with pytest.raises(AssertionError):
        assert_adapter_reached_engines(want, engines, base_checksums(tiny))
    assert all(sums == {**sums, **base_checksums(tiny)} for sums in engines)  # the base
