"""policyLoss: custom. A user's copy of PPO clip (tests/user_losses.py, written from the
formula, not calling kuberl's) trains exactly as the built-in through the fsdp backend on CPU:
the same loss, clip fraction and gradients, under two micro-batch sizes, with TIS and the KL
term on too (kuberl keeps them around the user's term). Broken functions are refused before
anything starts, naming algorithm.lossFunction and what was wrong."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kuberl_api import parse
from kuberl_api.spec import RLJobSpec
from kuberl_trainer.algos import LossInputs
from kuberl_trainer.algos.custom_loss import CustomLoss, LossFunctionError, synthetic_inputs
from kuberl_trainer.algos.objective import Objective
from kuberl_trainer.backends.factory import make_backend
from kuberl_trainer.backends.fsdp import FSDPBackend
from kuberl_trainer.preflight import PreflightError, check_loss
from tests import user_losses
from tests.unit.test_fsdp_backend import (  # noqa: F401  (model_dir: a fixture)
    B,
    capture_grads,
    make_batch,
    make_spec,
    model_dir,
    params,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28
BUILT_IN = {"epsClip": EPS_LOW, "epsClipHigh": EPS_HIGH}
CUSTOM = {"policyLoss": "custom", "lossFunction": "tests.user_losses:ppo_clip",
          "lossArgs": {"eps_low": EPS_LOW, "eps_high": EPS_HIGH}}
# kuberl's terms around the policy term: truncated IS (a cap some tokens' weights exceed),
# a k3 KL to the reference and an entropy bonus.
AROUND = {"tisCap": 1.1, "klCoef": 0.1, "klLossType": "k3", "entropyCoef": 0.01}
REL = 1e-6


def off_policy(backend: FSDPBackend, seed: int = 1) -> Any:
    """make_batch's rows with pi_old, the engines' and the reference's log-probs each up to
    0.4 away from the policy's: ratios of 0.67-1.5, so PPO clips some tokens, TIS truncates
    some weights and the KL term has a gradient."""
    batch = make_batch()
    now = backend.logprobs(batch)
    gen = torch.Generator().manual_seed(seed)

    def near() -> torch.Tensor:
        return (now + (torch.rand(now.shape, generator=gen) * 0.8 - 0.4)) * batch.loss_mask

    return dataclasses.replace(batch, old_logprobs=near(), rollout_logprobs=near(),
                               ref_logprobs=near())


@pytest.mark.parametrize("mbs", [2, B], ids=["micro-batches-of-2", "one-micro-batch"])
@pytest.mark.parametrize("around", [{}, AROUND], ids=["alone", "tis-kl-entropy"])
def test_a_users_ppo_clip_trains_as_the_built_in(model_dir: str,  # noqa: F811
                                                 monkeypatch: pytest.MonkeyPatch, mbs: int,
                                                 around: dict[str, Any]) -> None:
    built_in = make_backend(make_spec(model_dir, mbs=mbs, **BUILT_IN, **around), rank=0,
                            world_size=1, device="cpu")
    custom = make_backend(make_spec(model_dir, mbs=mbs, **CUSTOM, **around), rank=0,
                          world_size=1, device="cpu")
    assert isinstance(built_in, FSDPBackend) and isinstance(custom, FSDPBackend)
    batch = off_policy(built_in)
    grads = capture_grads(monkeypatch)

    ours, theirs = built_in.train_step(batch), custom.train_step(batch)

    assert 0 < ours["pg_clipfrac"] < 1  # the batch clips some tokens, not all
    assert theirs["loss_clipfrac"] == pytest.approx(ours["pg_clipfrac"], rel=REL)
    assert "pg_clipfrac" not in theirs  # (kuberl cannot know what a custom loss clips)
    for key in ("loss", "pg_loss", "ratio_mean", "ratio_max", "grad_norm",
                *(("tis_truncated_fraction", "kl_ref", "entropy") if around else ())):
        assert theirs[key] == pytest.approx(ours[key], rel=REL), key
    if around:
        assert 0 < ours["tis_truncated_fraction"] < 1 and ours["kl_ref"] > 0
    for g_ours, g_theirs in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(g_theirs, g_ours, rtol=REL, atol=1e-12)
    for name, value in params(built_in).items():
        torch.testing.assert_close(params(custom)[name], value, rtol=0, atol=1e-7)


def test_the_custom_term_is_micro_batch_invariant(model_dir: str,  # noqa: F811
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its metrics too: the clip fraction of micro-batches of 2 rows, combined by their
    tokens, is the whole batch's."""
    full = make_backend(make_spec(model_dir, mbs=B, **CUSTOM, **AROUND), rank=0, world_size=1,
                        device="cpu")
    micro = make_backend(make_spec(model_dir, mbs=2, **CUSTOM, **AROUND), rank=0,
                         world_size=1, device="cpu")
    assert isinstance(full, FSDPBackend)
    batch = off_policy(full)
    grads = capture_grads(monkeypatch)
    m_full, m_micro = full.train_step(batch), micro.train_step(batch)
    for g_full, g_micro in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(g_micro, g_full, rtol=1e-4, atol=1e-7)
    for key in ("loss", "pg_loss", "loss_clipfrac"):
        assert m_micro[key] == pytest.approx(m_full[key], rel=1e-5), key


def test_the_function_is_really_called() -> None:
    """The sign-flipped copy gives the opposite loss and gradient (the learning test's
    counterpart: tests/integration/test_algorithms.py makes the reward fall with it)."""
    def term(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        inp, logp = synthetic_inputs(with_ref=False)
        obj = Objective(policy_loss="custom",
                        custom_loss=CustomLoss.load(f"tests.user_losses:{name}"))
        partial, _ = obj.partial_loss(inp.logp, inp.old_logp, inp.advantages, inp.mask,
                                      entropy=inp.entropy, rollout_logp=inp.rollout_logp)
        partial.backward()
        assert logp.grad is not None
        return partial.detach(), logp.grad

    (loss, grad), (flipped, flipped_grad) = term("ppo_clip"), term("ppo_clip_flipped")
    assert loss != 0 and flipped == -loss
    torch.testing.assert_close(flipped_grad, -grad)


def test_the_function_sees_clean_padding_and_only_logps_gradient() -> None:
    """Off the mask every input is 0 (a NaN in a backend's padding never reaches the user's
    code), and whatever the function returns there is dropped."""
    seen: list[LossInputs] = []

    def spy(inp: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(inp)
        garbage = torch.where(inp.mask.bool(), 0.0, float("nan"))  # NaN off the mask
        return -inp.advantages * inp.logp + garbage, {"rows": 2.0}

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])

    def padded(value: float) -> torch.Tensor:  # NaN off the mask
        return torch.where(mask.bool(), value, float("nan"))

    logp = padded(-1.0).requires_grad_()
    obj = Objective(policy_loss="custom", custom_loss=CustomLoss("spy", spy))
    partial, metrics = obj.partial_loss(logp, padded(-1.1), padded(1.0), mask,
                                        entropy=padded(0.5), rollout_logp=padded(-1.2),
                                        ref_logp=padded(-0.9))
    partial.backward()
    inp = seen[0]
    for t in (inp.logp, inp.old_logp, inp.rollout_logp, inp.advantages, inp.entropy):
        assert torch.equal(t[~mask.bool()], torch.zeros(3))
    assert inp.logp.requires_grad and not any(t is not None and t.requires_grad for t in (
        inp.old_logp, inp.rollout_logp, inp.ref_logp, inp.advantages, inp.entropy))
    assert float(partial.detach()) == 3.0 and logp.grad is not None
    assert torch.equal(logp.grad, -mask)
    assert float(metrics["loss_rows"]) == 2.0 and "pg_clipfrac" not in metrics


def test_a_function_needs_no_kuberl_type() -> None:
    """Duck typing: the user's own tests can call it with any object of the same fields."""
    inp, _ = synthetic_inputs(with_ref=False)
    loss, metrics = user_losses.ppo_clip(SimpleNamespace(**vars(inp)))
    assert loss.shape == inp.mask.shape and set(metrics) == {"clipfrac"}


# ------------------------------------------------------------------------ refused at start

def custom_spec(function: str, **algorithm: Any) -> RLJobSpec:
    return parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                  "metadata": {"name": "x"},
                  "spec": {"model": {"path": "/m"}, "data": {"prompts": "/d.jsonl"},
                           "algorithm": {"policyLoss": "custom", "lossFunction": function,
                                         **algorithm}}}).spec


@pytest.mark.parametrize(("function", "args", "why"), [
    ("tests.no_such_module:loss", {}, r"cannot import module 'tests.no_such_module'"),
    ("tests.user_losses:missing", {}, r"has no attribute 'missing'"),
    ("tests.user_losses:summed_per_row", {},
     r"returned a loss of shape \[4\]; the per-token loss must be \[B, T\] = \[4, 6\]"),
    ("tests.user_losses:not_finite", {}, r"returned a loss that is not finite"),
    ("tests.user_losses:detached", {}, r"no gradient reaches inp.logp \(the loss is detached"),
    ("tests.user_losses:ignores_logp", {}, r"no gradient reaches inp.logp \(it is 0"),
    ("tests.user_losses:per_token_metric", {},
     r"returned metric 'ratio' of shape \[4, 6\]: a metric is a scalar"),
    ("tests.user_losses:raises", {"scale": 2}, r"raised RuntimeError: no loss at scale 2.0"),
    ("tests.user_losses:ppo_clip", {"eps": 0.2},
     r"raised TypeError: .*unexpected keyword argument 'eps'"),
    ("tests.user_losses:no_pair", {}, r"must return \(loss, metrics\)"),
], ids=["import-error", "no-such-function", "wrong-shape", "nan", "detached", "no-gradient",
        "non-scalar-metric", "raises", "unknown-loss-arg", "not-a-pair"])
def test_a_broken_function_is_refused_before_anything_starts(function: str,
                                                             args: dict[str, float],
                                                             why: str) -> None:
    with pytest.raises(PreflightError, match=r"^spec.algorithm.lossFunction: .*" + why):
        check_loss(custom_spec(function, lossArgs=args))


def test_a_good_function_passes_with_and_without_a_reference() -> None:
    for algorithm in ({}, {"klCoef": 0.1}):
        check_loss(custom_spec("tests.user_losses:ppo_clip", **algorithm))
    check_loss(custom_spec("tests.user_losses:ppo_clip_flipped", lossArgs={"eps_high": 0.3}))


def test_a_custom_loss_that_breaks_its_contract_later_fails_the_step() -> None:
    """The check runs once; the shape is checked on every call (no host sync needed)."""
    calls = iter([(torch.zeros(2, 3, requires_grad=True), {}), (torch.zeros(2), {})])
    loss = CustomLoss("changing", lambda inp: next(calls))
    inp, _ = synthetic_inputs(with_ref=False)
    inp = dataclasses.replace(inp, mask=torch.ones(2, 3))
    loss(inp)
    with pytest.raises(LossFunctionError, match=r"shape \[2\]"):
        loss(inp)
