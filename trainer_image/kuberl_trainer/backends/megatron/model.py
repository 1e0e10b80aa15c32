"""Megatron-core GPT models built from, loaded from and exported to Hugging Face checkpoints.

Imports megatron-core lazily (inside the functions): this module is imported by the backend,
which CPU-only machines never build, but its pure helpers (``local_name``, ``global_name``,
``stage_state``) are tested on CPU.

Layer spec: Transformer Engine's when it is installed (fused attention, fused layer norms; the
trainer image has it), else Megatron's local spec with SDPA core attention
(``sdpa_attention``), which is what the GPU machines without TE run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kuberl_trainer.backends.megatron import hf_layout as L, moe_layout as moe
from kuberl_trainer.backends.megatron.grouped_experts import grouped_experts_class
from kuberl_trainer.backends.megatron.sdpa_attention import local_spec_with_sdpa

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the model-parallel grid."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1        # expert parallelism (MoE models): ranks sharing out each layer's experts
    ep_rank: int = 0
    etp: int = 1       # expert tensor parallelism: ranks splitting each expert's matrices
    etp_rank: int = 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def read_hf_config(path: str | Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    return config


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(shape: L.DecoderShape, hf_config: Mapping[str, Any], par: Parallel,
                       dtype: torch.dtype, aux_loss_coef: float | None = None) -> Any:
    """Megatron's TransformerConfig for an HF decoder, computing in ``dtype``.

    ``calculate_per_token_loss``: the backend's loss is already normalised over the whole
    global batch (``algos.objective``), so Megatron must neither divide it by the number of
    micro-batches nor average gradients over data-parallel ranks (it sums them instead).
    ``variable_seq_lengths``: packed micro-batches differ in length, so pipeline stages send
    each activation's shape ahead of it.

    ``aux_loss_coef``: the MoE load-balancing loss's weight (None: the HF config's); see
    ``moe_settings``.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    te = has_transformer_engine()
    moe_kw = {} if shape.experts is None else moe_settings(shape, par, aux_loss_coef)
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn, normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)), gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
        # Megatron's jit-fused SwiGLU (measured: +8% step throughput, bench/RESULTS.md);
        # the other fusions need Transformer Engine or apex kernels.
        bias_activation_fusion=True, masked_softmax_fusion=False, persist_layer_norm=te,
        bias_dropout_fusion=False, apply_rope_fusion=te, gradient_accumulation_fusion=False,
        calculate_per_token_loss=True, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # (dense models; the default refuses variable
                                               # sequence lengths even without experts)
        # Weights come from the HF checkpoint (load_hf checks every parameter is filled):
        # allocate on the GPU and skip the random initialisation.
        use_cpu_initialization=False, perform_initialization=False, **moe_kw)


def moe_settings(shape: L.DecoderShape, par: Parallel, aux_loss_coef: float | None
                 ) -> dict[str, Any]:
    """TransformerConfig's MoE arguments for a Qwen MoE model (``shape.experts``).

    Routing as HF computes it: the softmax over all experts' logits, the top k, renormalised
    when ``norm_topk_prob`` -- which is exactly the softmax over the k chosen logits, megatron's
    default (``moe_router_pre_softmax=False``); without renormalising (Qwen2-MoE), the softmax
    comes first (``moe_router_pre_softmax=True``) and the top k keep their probabilities.
    Router logits in the activations' dtype, as HF and the engines compute them.

    Load balancing: Switch-style ``aux_loss`` as HF's (``E * sum_i f_i * P_i``), megatron
    attaching each layer's to the router's output (``MoEAuxLossAutoScaler``) so the backward
    takes it. HF averages it over the layers; megatron sums the layers', so each gets
    ``coef / layers`` (``moe_runtime.scale_aux_loss`` divides it further by the step's tokens
    before each step). Coefficient 0: no aux loss (``none``).
    """
    e = shape.experts
    assert e is not None
    coef = e.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return dict(
        num_moe_experts=e.experts, moe_router_topk=e.top_k, moe_ffn_hidden_size=e.ffn,
        moe_router_score_function="softmax", moe_router_pre_softmax=not e.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef / shape.num_layers if coef > 0 else 0.0,
        moe_shared_expert_intermediate_size=e.shared_ffn or None,
        moe_shared_expert_gate=e.shared_ffn > 0,
        expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.etp,
        # Without Transformer Engine there is no grouped GEMM: SequentialMLP runs the local
        # experts one after another. (Dispatcher: the all-to-all, set for every model.)
        moe_grouped_gemm=False)


def layer_spec(shape: L.DecoderShape) -> Any:
    experts = None if shape.experts is None else shape.experts.experts
    if has_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm)
    spec = local_spec_with_sdpa(qk_layernorm=shape.qk_norm, num_experts=experts)
    if experts is not None:  # SequentialMLP's parameters, grouped matrix products
        spec.submodules.mlp.submodules.experts.module = grouped_experts_class()
    return spec


def build_gpt(shape: L.DecoderShape, hf_config: Mapping[str, Any], par: Parallel,
              dtype: torch.dtype = torch.bfloat16, aux_loss_coef: float | None = None
              ) -> nn.Module:
    """This rank's GPTModel (its pipeline stage, its TP shard, its experts), on the current
    GPU, with uninitialised weights (``load_hf`` fills them)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if shape.experts is not None:
        _router_gemm_without_te()
    model: nn.Module = GPTModel(
        config=transformer_config(shape, hf_config, par, dtype, aux_loss_coef),
        transformer_layer_spec=layer_spec(shape),
        vocab_size=L.padded_vocab(shape.vocab, par.tp),
        max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
        pre_process=par.first_stage, post_process=par.last_stage,
        position_embedding_type="rope", **rope_settings(hf_config),
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True)  # logits stay vocab-parallel: see backends/vocab_logprobs.py
    # Every parameter in the compute dtype, norms included (Megatron's Float16Module does the
    # same): the local spec builds its norms in float32, which would then reach the engines as
    # float32 tensors where the checkpoint has bf16. The optimizer keeps fp32 master copies.
    model.to(device=torch.cuda.current_device(), dtype=dtype)
    return model


def _router_gemm_without_te() -> None:
    """megatron-core 0.16.1's router gating (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name it imports only with Transformer Engine: without
    TE every MoE forward raises NameError. Defined as None, the function takes its own
    ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def rope_settings(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """GPTModel's rotary arguments from an HF config: ``rope_theta`` (top level in older
    configs, under ``rope_parameters`` since transformers 5) and Llama 3.1's frequency
    scaling, which Megatron implements with the same constants (factor aside)."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": int(theta)}
    if kind == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        odd = {k: params[k] for k, v in expected.items() if k in params and params[k] != v}
        if odd:
            raise ValueError(f"llama3 rope scaling with {odd} is not supported by the megatron "
                             f"backend (it supports {expected})")
        out.update(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported by the megatron backend "
                         "(default and llama3 are)")
    return out


# -- names: Megatron's per-stage module numbering vs the global layer index ------------------


def local_name(name: str, par: Parallel, num_layers: int,
               experts: moe.ExpertShape | None = None) -> str | None:
    """The name a global Megatron tensor has in this rank's module (its pipeline stage's
    layer numbers, its ep rank's local expert numbers), or None when the rank does not hold
    it."""
    layers = L.stage_layers(num_layers, par.pp, par.pp_rank)
    match = _LAYER.match(name)
    if match:
        i = int(match.group(1))
        if i not in layers:
            return None
        name = f"decoder.layers.{i - layers.start}.{match.group(2)}"
        return name if experts is None else moe.to_local(name, experts, par.ep, par.ep_rank)
    if name.startswith("embedding."):
        return name if par.first_stage else None
    if name.startswith(("decoder.final_layernorm", "output_layer")):
        return name if par.last_stage else None
    raise ValueError(f"unknown Megatron tensor {name}")


def global_name(name: str, par: Parallel, num_layers: int,
                experts: moe.ExpertShape | None = None) -> str:
    """Inverse of ``local_name``."""
    match = _LAYER.match(name)
    if not match:
        return name
    first = L.stage_layers(num_layers, par.pp, par.pp_rank).start
    name = f"decoder.layers.{int(match.group(1)) + first}.{match.group(2)}"
    return name if experts is None else moe.to_global(name, experts, par.ep, par.ep_rank)


def stage_state(hf: Mapping[str, Tensor], shape: L.DecoderShape, par: Parallel
                ) -> dict[str, Tensor]:
    """This rank's share of a full HF state dict, in its module's names: its stage's tensors,
    its TP shard of each."""
    full = L.hf_to_megatron(hf, shape, tp=par.tp)
    if shape.experts is not None:
        shape.experts.check_parallel(par.ep, par.etp, par.tp)
    out = {}
    for name, tensor in full.items():
        local = local_name(name, par, shape.num_layers, shape.experts)
        if local is None:
            continue
        tp, rank = (par.etp, par.etp_rank) if moe.is_expert(name) else (par.tp, par.tp_rank)
        out[local] = L.tp_shard(name, tensor, shape, tp, rank).contiguous()
    if shape.tied and par.last_stage and not par.first_stage:
        # A tied model's last stage keeps its own copy of the embedding as the output layer
        # (Megatron keeps the two in sync by all-reducing their gradients).
        out["output_layer.weight"] = L.tp_shard(
            "output_layer.weight", full["embedding.word_embeddings.weight"], shape, par.tp,
            par.tp_rank).contiguous()
    return out


@torch.no_grad()
def load_hf(model: nn.Module, hf: Mapping[str, Tensor], shape: L.DecoderShape,
            par: Parallel) -> None:
    """Copy an HF state dict into this rank's module in place (so it works on a module whose
    parameters already live in Megatron DDP's contiguous buffers). Every parameter must be
    filled, and every tensor used: nothing is left at its random initialisation."""
    params = {name: p for name, p in model.named_parameters()}
    state = stage_state(hf, shape, par)
    missing = sorted(set(params) - set(state))
    unused = sorted(set(state) - set(params))
    if missing or unused:
        raise ValueError(f"HF checkpoint does not match the Megatron model: parameters not "
                         f"in the checkpoint {missing[:5]}, tensors with no parameter "
                         f"{unused[:5]}")
    for name, p in params.items():
        src = state[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model "
                             f"{tuple(p.shape)}")
        p.copy_(src)


def named_local_tensors(model: nn.Module, par: Parallel, num_layers: int,
                        experts: moe.ExpertShape | None = None) -> dict[str, Tensor]:
    """This rank's shards under their global Megatron names (the export plan's keys)."""
    out = {}
    for name, p in model.named_parameters():
        out[global_name(_unwrapped(name), par, num_layers, experts)] = p.detach()
    return out


def _unwrapped(name: str) -> str:
    """A parameter name without the wrappers' prefixes (Megatron DDP's ``module.``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name
