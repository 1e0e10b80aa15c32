"""GRPO on a mixture-of-experts policy trains on CPU: `kuberl run` of the tiny job on its
Qwen3-MoE build (`tiny build --variant moe`: 4 experts, top-2), colocated, with the fsdp
backend and a reference engine, the experts synced in the checkpoint's per-expert names. It
must learn as the dense job does (tests/integration/learning.py, scenario `moe`), the engine
must sample from the trainer's experts, and the warm start must route over every expert.

It learns in each routing replay mode (training, rollout; none is the same run as rollout
here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.integration import learning

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# A router that has collapsed onto k experts gives the others 0. Seed 0's build spreads each
# layer's tokens over all 4 experts, the least used taking 0.105 of the routed slots (an even
# spread is 0.25). (After the `moe` scenario's 8 GRPO steps, which add no load-balancing loss,
# the least used expert of some layer took 0.004-0.078 over seeds 0-3 and 5: RL drifts the
# routing, so the run's loads are printed, not judged.)
MIN_EXPERT_SHARE = 0.05
# The engine serves the trainer's float32 weights on CPU: its log-probs of the sampled tokens
# differ from the trainer's by float noise only (test_local_run.py's bound). An expert synced
# under the wrong name or into the wrong half of transformers' fused gate_up_proj would move
# them by far more.
FP32_GAP_MAX = 1e-4


def test_the_moe_build_routes_tokens_over_every_expert(tiny_moe: Path) -> None:
    record = json.loads((tiny_moe / "build.json").read_text())
    loads = record["expert_loads"]
    assert len(loads) == 4, loads
    assert all(min(layer) > MIN_EXPERT_SHARE for layer in loads), loads


# (The `moe` scenario, replay none, is left to bench/learning_margins.py: on this engine, which
# holds the trainer's float32 weights and routes as it does, the rollout-replay run trains
# exactly as it, gain for gain over seeds 0-3, bench/RESULTS.md.)
@pytest.mark.parametrize("name", list(learning.MOE_REPLAY))
def test_grpo_on_a_moe_policy_learns(tiny_moe: Path, tmp_path: Path, name: str) -> None:
    from kuberl_trainer.tiny.data import Problem, read_jsonl
    from kuberl_trainer.tiny.evaluate import expert_loads

    scenario = learning.SCENARIOS[name]
    outcome = scenario.run(tiny_moe, tmp_path)
    rows = outcome.rows
    assert [r["step"] for r in rows] == list(range(scenario.steps))
    for r in rows:
        assert r["rollout_logp_abs_diff_max"] < FP32_GAP_MAX, r
        # the router's load-balancing loss trains with the model's own coefficient (0.001)
        assert r["moe_aux_loss"] > 0, r
    mismatch = [r.get("routing_replay_mismatch") for r in rows]
    if name == "moe-replay-rollout":
        # the engine routes as the trainer would (same float32 weights): nothing to change
        assert all(m is not None and m < 0.01 for m in mismatch), mismatch
    else:  # training: the second optimizer step replays the first's experts after an update
        assert all(m is not None and 0 <= m < 0.5 for m in mismatch), mismatch
        assert all(r["old_logprobs_recomputed"] == 1 for r in rows)
    # every sync sent the whole model, experts included (4 bytes a float32 parameter)
    params = json.loads((tiny_moe / "build.json").read_text())["params"]
    assert {r["weight_sync_bytes"] for r in rows} == {4 * params}
    failures = scenario.failures(outcome)
    assert not failures, failures
    final = learning.final_model(outcome.out)
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in set(f.keys())
    model, tokenizer = learning._load(final)
    problems = [Problem(*map(int, r["prompt"][:-1].split("+")))
                for r in read_jsonl(tiny_moe / "data" / "eval.jsonl")]
    # what `pytest -rP` shows: how far the run moved the routing (see MIN_EXPERT_SHARE)
    print(f"expert loads after GRPO: {expert_loads(model, tokenizer, problems)}")
