"""The fsdp backend on CPU against a tiny random Qwen2 (tied embeddings, vocab 32).

Checks the contracts the loop relies on: the log-prob shift and temperature, the direction
and bookkeeping of a training step, micro-batch invariance of the update, exact resume,
HF-named weight buckets, and DDP over gloo with two processes.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from kuberl_api.spec import RLJobSpec
from kuberl_trainer.backends import fsdp
from kuberl_trainer.backends.base import Backend, TrainBatch
from kuberl_trainer.backends.factory import make_backend
from kuberl_trainer.backends.fsdp import FSDPBackend
from kuberl_trainer.backends.optim import OptimConfig, clip_gradients
from kuberl_trainer.backends.step_metrics import combine_ranks
from tests.unit.tiny_lm import VOCAB, save_tiny_qwen2

B, T = 8, 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def make_spec(model_dir: str, *, mbs: int = 2, gbs: int = B, lr: float = 1e-2,
              sft: dict[str, Any] | None = None, max_tokens: int | None = None,
              **algorithm: Any) -> RLJobSpec:
    budget = {} if max_tokens is None else {"maxTokensPerMicroBatch": max_tokens}
    return RLJobSpec.model_validate({
        "model": {"path": model_dir},
        "data": {"prompts": "/data/prompts.jsonl", "rolloutBatchSize": B // 2,
                 "nSamplesPerPrompt": 2, "maxPromptLen": 4, "maxResponseLen": T - 4,
                 **({"sft": sft} if sft else {})},
        "training": {"backend": "fsdp", "gpusPerNode": 0, "microBatchSize": mbs,
                     "globalBatchSize": gbs, **budget},
        "rollout": {"engine": "reference"},  # on CPU
        "algorithm": {"lr": lr, **algorithm},
    })


def make_batch(seed: int = 0) -> TrainBatch:
    """Prompts of 2-4 tokens, responses of 1-7 tokens, right-padded to T; advantages +-1
    per sequence (so micro-batches hold different token counts)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    attention = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    for i in range(B):
        prompt = 2 + i % 3
        length = prompt + 1 + (i * 5) % 7
        attention[i, :length] = 1
        loss_mask[i, prompt:length] = 1.0
        input_ids[i, length:] = 0
    signs = torch.where(torch.arange(B) % 2 == 0, 1.0, -1.0)
    zeros = torch.zeros(B, T)
    return TrainBatch(input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask,
                      advantages=signs[:, None] * loss_mask, old_logprobs=zeros,
                      rollout_logprobs=zeros.clone())


def with_old(backend: Backend, batch: TrainBatch) -> TrainBatch:
    return dataclasses.replace(batch, old_logprobs=backend.logprobs(batch),
                               ref_logprobs=backend.ref_logprobs(batch))


def params(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.module.state_dict().items()}


# -- log-probs ---------------------------------------------------------------------------


def test_logprobs_match_a_hand_computation(model_dir: str) -> None:
    temperature = 0.7
    backend = make_backend(make_spec(model_dir, temperature=temperature), rank=0,
                           world_size=1, device="cpu")
    batch = make_batch()
    got = backend.logprobs(batch)

    hf = Qwen2ForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.zeros(B, T)
    for b in range(B):
        for t in range(1, T):
            if batch.loss_mask[b, t]:  # token t is predicted by the logits at t - 1
                dist_t = torch.log_softmax(logits[b, t - 1] / temperature, dim=-1)
                expected[b, t] = dist_t[batch.input_ids[b, t]]

    assert got.shape == (B, T) and got.device.type == "cpu"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(got[batch.loss_mask == 0] == 0) and torch.all(got[:, 0] == 0)
    assert backend.ref_logprobs(batch) is None  # klCoef 0: no reference model


def test_reference_equals_policy_before_training(model_dir: str) -> None:
    backend = make_backend(make_spec(model_dir, klCoef=0.1), rank=0, world_size=1,
                           device="cpu")
    batch = make_batch()
    ref = backend.ref_logprobs(batch)
    assert ref is not None and torch.equal(ref, backend.logprobs(batch))


# -- training ----------------------------------------------------------------------------


def test_train_step_raises_logprobs_of_positive_advantage_tokens(model_dir: str) -> None:
    backend = make_backend(make_spec(model_dir, klCoef=0.05, entropyCoef=0.01), rank=0,
                           world_size=1, device="cpu")
    batch = with_old(backend, make_batch())
    metrics = backend.train_step(batch)

    after = backend.logprobs(batch)
    positive = batch.advantages > 0
    negative = batch.advantages < 0
    assert after[positive].sum() > batch.old_logprobs[positive].sum()
    assert after[negative].sum() < batch.old_logprobs[negative].sum()
    for key in ("pg_loss", "pg_clipfrac", "approx_kl", "entropy", "kl_ref", "grad_norm", "lr",
                "ratio_max", "ratio_min", "loss"):
        assert np.isfinite(metrics[key]), key
    assert metrics["lr"] == pytest.approx(1e-2)
    assert metrics["optimizer_steps"] == 1
    assert metrics["pg_clipfrac"] == 0.0 and abs(metrics["approx_kl"]) < 1e-6  # on-policy
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert metrics["entropy"] > 0


def capture_grads(monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    """Record every parameter's accumulated gradient as it reaches clipping."""
    seen: list[list[torch.Tensor]] = []

    def recording_clip(params: Any, *args: Any) -> float:
        params = list(params)
        seen.append([p.grad.clone() for p in params])
        return clip_gradients(params, *args)

    monkeypatch.setattr(fsdp, "clip_gradients", recording_clip)  # what train_step calls
    return seen


OBJECTIVES = {
    "token-mean": {},
    "seq-mean-token-mean": {"lossAggregation": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"lossAggregation": "seq-mean-token-sum"},
    "dr-grpo-norm": {"lossAggregation": "seq-mean-token-sum-norm"},
    "gspo": {"policyLoss": "gspo", "lossAggregation": "seq-mean-token-mean", "epsClip": 3e-4,
             "epsClipHigh": 4e-4},
    "cispo": {"policyLoss": "cispo", "cispoEpsHigh": 0.1, "cispoEpsLow": 0.1},
    "sapo": {"policyLoss": "sapo", "lossAggregation": "seq-mean-token-mean"},
    "gpg": {"policyLoss": "gpg"},
    "tis-kl-entropy": {"tisCap": 2.0, "klCoef": 0.1, "entropyCoef": 0.01},
    "masked-is-by-sequence": {"importanceMask": {"level": "sequence", "low": 0.9,
                                                 "high": 1.1}},
}


@pytest.mark.parametrize("algorithm", OBJECTIVES.values(), ids=OBJECTIVES.keys())
def test_micro_batches_accumulate_to_the_full_batch_update(
        model_dir: str, monkeypatch: pytest.MonkeyPatch, algorithm: dict[str, Any]) -> None:
    """Every loss aggregation, policy loss and extra term: micro-batches of 2 sequences (of
    unequal token counts) update exactly as the whole batch at once."""
    full = make_backend(make_spec(model_dir, mbs=B, **algorithm), rank=0, world_size=1,
                        device="cpu")
    micro = make_backend(make_spec(model_dir, mbs=2, **algorithm), rank=0, world_size=1,
                         device="cpu")
    assert isinstance(full, FSDPBackend) and isinstance(micro, FSDPBackend)
    batch = with_old(full, make_batch())
    grads = capture_grads(monkeypatch)

    m_full, m_micro = full.train_step(batch), micro.train_step(batch)

    # Gradients, not just parameters: Adam's first step is ~lr * sign(grad), blind to scale.
    for g_full, g_micro in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(g_micro, g_full, rtol=1e-4, atol=1e-7)
    assert m_micro["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5)
    assert m_micro["pg_loss"] == pytest.approx(m_full["pg_loss"], rel=1e-5, abs=1e-7)
    assert m_micro["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-7)
    assert m_micro["ratio_max"] == pytest.approx(m_full["ratio_max"], rel=1e-5)
    for name, value in params(full).items():
        torch.testing.assert_close(params(micro)[name], value, rtol=0, atol=1e-5)


def test_a_token_budget_cuts_the_passes_and_keeps_the_update(
        model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """maxTokensPerMicroBatch: each forward pass packs at most that many tokens, no padding,
    and the update is the one a single pass over the whole batch makes."""
    full = make_backend(make_spec(model_dir, mbs=B), rank=0, world_size=1, device="cpu")
    budget = make_backend(make_spec(model_dir, max_tokens=T), rank=0, world_size=1,
                          device="cpu")
    assert isinstance(full, FSDPBackend) and isinstance(budget, FSDPBackend)
    batch = with_old(full, make_batch())
    passes: list[int] = []
    forward = FSDPBackend._forward

    def counting(self: FSDPBackend, model: Any, mb: Any) -> torch.Tensor:
        passes.append(mb.packed.tokens)
        return forward(self, model, mb)

    monkeypatch.setattr(FSDPBackend, "_forward", counting)
    grads = capture_grads(monkeypatch)
    full.train_step(batch)
    whole = list(passes)
    passes.clear()
    budget.train_step(batch)

    real = int(batch.attention_mask.sum())
    assert whole == [real]              # one pass over every real token, no padding
    assert sum(passes) == real and max(passes) <= T and len(passes) >= real // T
    for g_full, g_cut in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(g_cut, g_full, rtol=1e-4, atol=1e-7)


def test_several_optimizer_steps_per_rollout(model_dir: str) -> None:
    backend = make_backend(make_spec(model_dir, mbs=2, gbs=4), rank=0, world_size=1,
                           device="cpu")
    metrics = backend.train_step(with_old(backend, make_batch()))
    assert metrics["optimizer_steps"] == 2  # 8 samples / globalBatchSize 4
    with pytest.raises(ValueError, match="multiple of its share"):
        backend.train_step(make_batch().slice(0, 3))


def test_a_samples_rows_train_in_one_optimizer_step(model_dir: str) -> None:
    """rollout.maxRowsPerSample: globalBatchSize counts samples, so the 8 rows of 4 samples
    (2 rows each) with globalBatchSize 2 make 2 optimizer steps of 4 rows, not 4 of 2."""
    spec = make_spec(model_dir, mbs=1, gbs=2).model_dump(by_alias=True)
    spec["data"].update(rolloutBatchSize=2, nSamplesPerPrompt=2)
    spec["rollout"].update(function="agent:run", maxRowsPerSample=2)
    rows = RLJobSpec.model_validate(spec)
    assert (rows.global_batch_size, rows.global_batch_rows) == (2, 4)
    backend = make_backend(rows, rank=0, world_size=1, device="cpu")
    assert backend.train_step(with_old(backend, make_batch()))["optimizer_steps"] == 2


@pytest.mark.parametrize("gbs", [B, B // 2], ids=["one-step", "two-steps"])
def test_missing_old_logprobs_train_like_precomputed_ones(model_dir: str, gbs: int) -> None:
    """The loop leaves old_logprobs out. With one optimizer step per rollout the training
    forward's own log-probs stand in (no extra forward pass); with several, the backend
    computes them before the first step. Either way the update equals the one from
    log-probs computed up front."""
    given = make_backend(make_spec(model_dir, gbs=gbs), rank=0, world_size=1, device="cpu")
    left_out = make_backend(make_spec(model_dir, gbs=gbs), rank=0, world_size=1, device="cpu")
    assert isinstance(given, FSDPBackend) and isinstance(left_out, FSDPBackend)
    batch = make_batch()
    m_given = given.train_step(with_old(given, batch))
    m_left_out = left_out.train_step(dataclasses.replace(batch, old_logprobs=None))

    assert m_left_out["optimizer_steps"] == B // gbs
    assert m_left_out["pg_loss"] == pytest.approx(m_given["pg_loss"], rel=1e-5, abs=1e-7)
    assert m_left_out["pg_clipfrac"] == m_given["pg_clipfrac"]
    for name, value in params(given).items():
        torch.testing.assert_close(params(left_out)[name], value, rtol=0, atol=1e-6)


def test_engine_old_logprobs_skip_the_trainers_forward_and_train_on_the_engines(
        model_dir: str) -> None:
    """oldLogprobs: engine over two optimizer steps: no forward pass for pi_old (trainer mode
    makes one); where the engines' log-probs equal the trainer's, the update is the one
    trainer mode makes, and the gap (measured in the first step) is 0; engines' log-probs
    off by 0.01 per token show as that gap, and move the update."""
    batch = dataclasses.replace(make_batch(), old_logprobs=None)
    trainer = make_backend(make_spec(model_dir, gbs=B // 2), rank=0, world_size=1,
                           device="cpu")
    engine = make_backend(make_spec(model_dir, gbs=B // 2, oldLogprobs="engine"), rank=0,
                          world_size=1, device="cpu")
    shifted = make_backend(make_spec(model_dir, gbs=B // 2, oldLogprobs="engine"), rank=0,
                           world_size=1, device="cpu")
    assert isinstance(trainer, FSDPBackend) and isinstance(engine, FSDPBackend)
    assert isinstance(shifted, FSDPBackend)
    sampled = dataclasses.replace(batch, rollout_logprobs=trainer.logprobs(batch))
    m_trainer = trainer.train_step(sampled)
    m_engine = engine.train_step(sampled)
    assert (m_trainer["old_logprobs_recomputed"], m_engine["old_logprobs_recomputed"]) == (1, 0)
    assert m_engine["optimizer_steps"] == 2
    for name, value in params(trainer).items():
        torch.testing.assert_close(params(engine)[name], value, rtol=0, atol=1e-6)
    for m in (m_trainer, m_engine):
        assert m["rollout_logp_abs_diff_mean"] < 1e-6 and m["rollout_logp_abs_diff_max"] < 1e-5
    off = dataclasses.replace(sampled, rollout_logprobs=(sampled.rollout_logprobs - 0.01)
                              * sampled.loss_mask)
    m_shifted = shifted.train_step(off)
    assert m_shifted["rollout_logp_diff"] == pytest.approx(0.01, abs=1e-5)
    assert m_shifted["rollout_seq_log_ratio_min"] == pytest.approx(0.01, abs=1e-5)
    assert m_shifted["ratio_max"] > 1.005  # the ratio is against the engines' log-probs
    moved = max(float((params(shifted)[k] - v).abs().max()) for k, v in params(engine).items())
    assert moved > 0


def test_save_load_resumes_exactly(model_dir: str, tmp_path: Path) -> None:
    optim = OptimConfig(warmup_steps=4)  # the lr then depends on the restored scheduler
    spec = make_spec(model_dir)
    first, second = make_batch(0), make_batch(1)

    a = FSDPBackend(spec, rank=0, world_size=1, device="cpu", optim=optim)
    a.train_step(with_old(a, first))
    a.save(tmp_path / "ckpt")
    draws_a = (random.random(), np.random.rand(), torch.rand(2))
    metrics_a = a.train_step(with_old(a, second))

    random.seed(123), np.random.seed(123), torch.manual_seed(123)  # disturb every RNG
    b = FSDPBackend(spec, rank=0, world_size=1, device="cpu", optim=optim)
    b.load(tmp_path / "ckpt")
    draws_b = (random.random(), np.random.rand(), torch.rand(2))
    metrics_b = b.train_step(with_old(b, second))

    assert draws_a[:2] == draws_b[:2] and torch.equal(draws_a[2], draws_b[2])
    assert metrics_a == metrics_b
    for name, value in params(a).items():
        assert torch.equal(params(b)[name], value), name
    # The model directory is a plain HF checkpoint.
    reloaded = Qwen2ForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert set(reloaded.state_dict()) == set(params(a))


# -- weight buckets ----------------------------------------------------------------------


def test_named_tensor_buckets_cover_state_dict_with_hf_names(model_dir: str) -> None:
    backend = make_backend(make_spec(model_dir), rank=0, world_size=1, device="cpu")
    assert isinstance(backend, FSDPBackend)
    limit = 4096  # the embedding is exactly 4096 bytes; each MLP matrix (8192) is oversize
    buckets = list(backend.named_tensor_buckets(limit, tied_aliases=True))

    names = [name for bucket in buckets for name, _ in bucket]
    expected = list(Qwen2ForCausalLM.from_pretrained(model_dir).state_dict())
    assert names == expected and len(set(names)) == len(names)
    assert "lm_head.weight" in names  # tied, but a state_dict key: strict loading needs it
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
    assert any(len(b) == 1 and b[0][1].numel() * 4 > limit for b in buckets)

    fresh = Qwen2ForCausalLM(Qwen2Config.from_pretrained(model_dir))
    fresh.load_state_dict({n: t for bucket in buckets for n, t in bucket}, strict=True)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, backend.module.state_dict()[name])

    untied = [n for b in backend.named_tensor_buckets(limit) for n, _ in b]
    on_disk = load_file(Path(model_dir) / "model.safetensors")
    assert sorted(untied) == sorted(on_disk)  # what save_pretrained writes (and sync sends)


def test_sync_buckets_hold_a_tied_embedding_once_in_the_engine_dtype(model_dir: str) -> None:
    """What weight sync sends to a bf16 engine: every tensor once (the tied lm_head.weight
    left out, as HF saves it) and cast to bf16 — under half the bytes of the fp32 master
    weights with both tied names (the issue's 2.52 GB for 0.99 GB)."""
    backend = make_backend(make_spec(model_dir), rank=0, world_size=1, device="cpu")
    assert isinstance(backend, FSDPBackend)
    master = backend.module.state_dict()
    sent = [kv for bucket in backend.named_tensor_buckets(4096, torch.bfloat16) for kv in bucket]

    names = [n for n, _ in sent]
    assert "lm_head.weight" not in names and len(set(names)) == len(names)
    assert "model.embed_tokens.weight" in names
    assert sorted(names) == sorted(load_file(Path(model_dir) / "model.safetensors"))
    assert {t.dtype for _, t in sent} == {torch.bfloat16}
    for name, tensor in sent:
        assert torch.equal(tensor, master[name].to(torch.bfloat16)), name
    assert all(t.dtype == torch.float32 for t in master.values())  # the master stays fp32

    def size(named: Any) -> int:
        return sum(t.numel() * t.element_size() for _, t in named)

    before = size(master.items())  # fp32, lm_head.weight and the embedding both sent
    embedding = master["model.embed_tokens.weight"]
    assert size(sent) == (before - embedding.numel() * 4) // 2
    assert size(sent) < before / 2


def test_megatron_backend_refuses_cpu_before_touching_megatron(model_dir: str) -> None:
    """The spec rules refuse megatron without GPUs; a backend built on CPU anyway says so
    plainly instead of failing inside megatron-core (which CPU machines don't have)."""
    spec = make_spec(model_dir)
    spec.training.backend = "megatron"
    with pytest.raises(ValueError, match="needs GPUs"):
        make_backend(spec, rank=0, world_size=1, device="cpu")


# -- DDP over gloo -----------------------------------------------------------------------


def _ddp_worker(rank: int, world_size: int, init_file: str, model_dir: str, out: str,
                algorithm: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        backend = make_backend(make_spec(model_dir, **algorithm), rank=rank,
                               world_size=world_size, device="cpu")
        shard = make_batch().split(world_size)[rank]
        metrics = backend.train_step(with_old(backend, shard))
        names = [n for bucket in backend.named_tensor_buckets(1 << 20, tied_aliases=True)
                 for n, _ in bucket]
        assert isinstance(backend, FSDPBackend) and backend.mode == "ddp"
        torch.save({"params": params(backend), "names": names, "metrics": metrics},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# The built-in loss, and a job's own (policyLoss: custom; its module imported by each rank).
DDP_LOSSES = {"ppo": {}, "custom": {"policyLoss": "custom",
                                    "lossFunction": "tests.user_losses:ppo_clip"}}


@pytest.mark.parametrize("algorithm", DDP_LOSSES.values(), ids=DDP_LOSSES.keys())
def test_ddp_two_ranks_over_gloo_match_single_process(model_dir: str, tmp_path: Path,
                                                      algorithm: dict[str, Any]) -> None:
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), model_dir, str(tmp_path),
                                algorithm), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for name, value in rank0["params"].items():
        assert torch.equal(rank1["params"][name], value), name
    assert rank0["names"] == list(rank0["params"])  # HF names: no DDP "module." prefix

    # Same global batch in one process: the token-mean is global, so the update matches.
    single = make_backend(make_spec(model_dir, **algorithm), rank=0, world_size=1,
                          device="cpu")
    assert isinstance(single, FSDPBackend)
    metrics = single.train_step(with_old(single, make_batch()))
    # The pre-clip gradient norm pins the scale (DDP averages; the loss pre-multiplies by
    # world_size), which the first Adam update alone would not reveal.
    assert rank0["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    for name, value in params(single).items():
        torch.testing.assert_close(rank0["params"][name], value, rtol=0, atol=1e-5)
    # The ranks' token-means (a custom loss's own metrics too) combine into the whole batch's.
    combined = combine_ranks([rank0["metrics"], rank1["metrics"]])
    for key in [k for k in metrics if k == "pg_loss" or k.startswith("loss_")]:
        assert combined[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


def test_distillation_loads_the_teacher_as_the_frozen_model(model_dir: str,
                                                            tmp_path: Path) -> None:
    teacher = save_tiny_qwen2(tmp_path / "teacher", seed=1)  # same shape, other weights
    backend = make_backend(make_spec(model_dir, advantageEstimator="on_policy_distillation",
                                     teacherPath=teacher), rank=0, world_size=1,
                           device="cpu")
    batch = make_batch()
    ref = backend.ref_logprobs(batch)  # with klCoef 0: the teacher is there for the signal
    assert ref is not None
    assert not torch.allclose(ref, backend.logprobs(batch))


def demonstrations(seed: int = 5) -> TrainBatch:
    """make_batch's layout, as demonstrations: the loss mask marks the targets."""
    return dataclasses.replace(make_batch(seed), advantages=torch.zeros(B, T))


def test_sft_term_lowers_the_demonstrations_nll(model_dir: str) -> None:
    spec = make_spec(model_dir, lr=1e-2, sftCoef=1.0, sft={"path": "/d.jsonl", "batchSize": B})
    backend = make_backend(spec, rank=0, world_size=1, device="cpu")
    assert isinstance(backend, FSDPBackend)
    rl = dataclasses.replace(with_old(backend, make_batch()), advantages=torch.zeros(B, T))
    sft = demonstrations()
    mask = sft.loss_mask.bool()
    before = -backend.logprobs(sft)[mask].mean()
    first = backend.train_step(rl, sft)["sft_nll"]
    assert first == pytest.approx(float(before), rel=1e-4)  # the metric is the token-mean NLL
    for _ in range(5):
        backend.train_step(rl, sft)
    after = -backend.logprobs(sft)[mask].mean()
    assert after < before - 0.1, (float(before), float(after))


def test_sft_term_is_micro_batch_invariant(model_dir: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    sft_spec = {"path": "/d.jsonl", "batchSize": B}
    full = make_backend(make_spec(model_dir, mbs=B, sftCoef=0.5, sft=sft_spec), rank=0,
                        world_size=1, device="cpu")
    micro = make_backend(make_spec(model_dir, mbs=2, sftCoef=0.5, sft=sft_spec), rank=0,
                         world_size=1, device="cpu")
    assert isinstance(full, FSDPBackend) and isinstance(micro, FSDPBackend)
    batch, sft = with_old(full, make_batch()), demonstrations()
    grads = capture_grads(monkeypatch)
    m_full, m_micro = full.train_step(batch, sft), micro.train_step(batch, sft)
    for g_full, g_micro in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(g_micro, g_full, rtol=1e-4, atol=1e-7)
    assert m_micro["sft_nll"] == pytest.approx(m_full["sft_nll"], rel=1e-5)
    assert m_micro["loss"] == pytest.approx(m_full["loss"], rel=1e-5)


def test_sft_must_split_into_the_optimizer_steps(model_dir: str) -> None:
    spec = make_spec(model_dir, gbs=B // 2, sftCoef=1.0, sft={"path": "/d.jsonl", "batchSize": 2})
    backend = make_backend(spec, rank=0, world_size=1, device="cpu")
    with pytest.raises(ValueError, match="optimizer steps"):
        backend.train_step(with_old(backend, make_batch()), demonstrations().slice(0, 3))


# -- agents' trajectories ----------------------------------------------------------------


def test_a_trajectorys_environment_tokens_get_no_loss_gradient(
        model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-turn trajectory packed as the rollout packs it and trained by the backend: the
    logits that score the environment's tokens get exactly zero gradient, every model
    token's logits some (the environment's tokens still condition the later turns)."""
    from kuberl_trainer.agents import Trajectory
    from kuberl_trainer.rollout.batch import pack
    from kuberl_trainer.rollout.generate import Response
    from kuberl_trainer.rollout.prompts import Sample

    rows = []
    for k in range(2):  # two trajectories, one group: advantages +1 and -1
        traj = Trajectory(prompt_ids=[3, 4, 5], budget=T - 3)
        traj.append_model([6 + k, 7], [-1.0, -1.0], "v0", "stop")
        traj.append_env([8, 9, 10])  # an observation, out of the loss
        traj.append_model([11, 12 + k], [-1.0, -1.0], "v0", "stop")
        sample = Sample("p", "l", index=0, epoch=0)
        rows.append(Response.from_trajectory(sample, traj, ""))
    batch = pack(rows, torch.tensor([1.0, -1.0]), pad_id=0)
    backend = make_backend(make_spec(model_dir, mbs=2, gbs=2), rank=0, world_size=1,
                           device="cpu")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input ids, logits' gradient)
    module = backend.module.module if hasattr(backend.module, "module") else backend.module

    def keep_grad(_: Any, args: Any, kwargs: Any, out: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if out.logits.requires_grad:  # the training pass, not the log-prob passes
            out.logits.register_hook(lambda g: seen.append((ids.detach(), g.detach())))

    module.register_forward_hook(keep_grad, with_kwargs=True)
    backend.train_step(with_old(backend, batch))
    ids, grad = seen[-1]
    # the pass may pack the rows into one (varlen): match each row's tokens in it
    flat_ids, flat_grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
    start = 0
    for b in range(2):
        n = int(batch.attention_mask[b].sum())
        row = batch.input_ids[b, :n]
        while not torch.equal(flat_ids[start:start + n], row):
            start += 1
        for t in range(1, n):
            scored = flat_grad[start + t - 1].abs().sum()  # the logits that score token t
            if batch.loss_mask[b, t] == 0:  # a prompt or environment token
                assert scored == 0, (b, t)
            else:
                assert scored > 0, (b, t)
        start += n
    assert batch.loss_mask[0, 3:10].tolist() == [1, 1, 0, 0, 0, 1, 1]
