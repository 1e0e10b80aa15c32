"""How the fsdp backend gets its HF models: loaded on the host in float32 (the master weights)
with the packed-rows attention, placed for the run's parallel mode (one device, DDP, or FSDP2
with each decoder layer sharded), and their full tensors read back (tied weights' aliases,
DTensor gathers). Kept apart from the backend's training and checkpoint logic (fsdp.py) so
that the value model (value.py) and LoRA (lora.py's adapter goes on before `place`) share
it."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from kuberl_trainer.backends.fused_kernels import NONE, apply_fused_kernels
from kuberl_trainer.backends.varlen_attention import register_hf_attention

Mode = Literal["single", "ddp", "fsdp2"]
_M = TypeVar("_M", bound=nn.Module)


def parallel_mode(world_size: int, device: torch.device) -> Mode:
    if world_size == 1:
        return "single"
    return "fsdp2" if device.type == "cuda" else "ddp"


def rank_batch_size(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Samples per optimizer step on one rank; the spec validates the same divisibility."""
    if global_batch % (world_size * micro_batch):
        raise ValueError(f"globalBatchSize {global_batch} must be a multiple of "
                         f"microBatchSize * ranks = {micro_batch} * {world_size}")
    return global_batch // world_size


def preload(path: str) -> None:
    """Import the model's classes (transformers imports a model family's module when a
    checkpoint first names it) ahead of ``build_model`` (factory.preload_backend). Best effort:
    a checkpoint it cannot read fails later, in the build, with the build's error."""
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # (the lazy mapping imports the module)
    except (OSError, ValueError, KeyError):
        pass


def build_model(path: str, device: torch.device, mode: Mode, *, trainable: bool,
                auto_class: Any = AutoModelForCausalLM, fused_kernels: str = NONE,
                **kwargs: Any) -> PreTrainedModel:
    """``load_model``, then ``place``."""
    return place(load_model(path, trainable=trainable, auto_class=auto_class,
                            fused_kernels=fused_kernels, **kwargs), device, mode)


def load_model(path: str, *, trainable: bool, auto_class: Any = AutoModelForCausalLM,
               fused_kernels: str = NONE, **kwargs: Any) -> PreTrainedModel:
    """Load the HF model (a causal LM unless ``auto_class`` says otherwise) on the host in
    float32 (the master weights), with ``fused_kernels`` (``fused_kernels.py``), in eval
    mode. Its attention runs packed rows (``varlen_attention``), which is all the backend
    gives it."""
    model: PreTrainedModel = auto_class.from_pretrained(
        path, local_files_only=True, dtype=torch.float32,
        attn_implementation=register_hf_attention(), **kwargs)
    apply_fused_kernels(model, fused_kernels)
    model.train(False)  # eval mode, no dropout ever: see the module docstring
    if not trainable:
        model.requires_grad_(False)
    return model


def place(model: _M, device: torch.device, mode: Mode) -> _M:
    """``model`` where ``mode`` trains it: sharded over the ranks (FSDP2), else on
    ``device``."""
    if mode == "fsdp2":
        _fully_shard(model)  # moves each rank's shard to its GPU; the full copy stays on CPU
        return model
    nn.Module.to(model, device)  # in place (HF's own `to` wrapper confuses type checkers)
    return model


def _fully_shard(model: nn.Module) -> None:
    """FSDP2: one shard group per decoder layer (HF's ``_no_split_modules``) plus the root,
    so only one layer's full parameters are materialised at a time. A PEFT model's adapter
    matrices first get groups of their own, gathered in float32: in bf16 groups (alone or
    beside their layer's frozen weights) their gradients came back from the reduce-scatter
    in bf16, which torch refused to assign to the float32 shards (2 H200s, torch 2.11:
    bench/RESULTS.md); they are tiny, so float32 costs nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = getattr(model, "get_base_model", None)  # (a PEFT model's HF model)
    hf = base() if callable(base) else model
    if hf is not model:
        adapter = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for sub in model.modules():
            own = list(sub.parameters(recurse=False))
            if isinstance(sub, nn.Linear) and own and all(p.requires_grad for p in own):
                fully_shard(sub, mp_policy=adapter)
    layer_types = set(getattr(hf, "_no_split_modules", None) or ())
    for sub in model.modules():
        if type(sub).__name__ in layer_types:
            fully_shard(sub, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if dev.index is not None
                           else torch.cuda.current_device())
        torch.cuda.set_device(dev)  # FSDP2's default mesh and NCCL use the current device
    return dev


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``{alias: source}`` for state-dict names that repeat an earlier entry's tensor, e.g.
    ``{"lm_head.weight": "model.embed_tokens.weight"}`` in a model with tied embeddings."""
    first: dict[int, str] = {}
    aliases = {}
    for name, value in module.state_dict(keep_vars=True).items():
        source = first.setdefault(id(value), name)
        if source != name:
            aliases[name] = source
    return aliases


def with_tied_aliases(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """``state`` plus the tied aliases HF's safetensors files leave out, so it loads with
    ``strict=True`` (a genuinely missing or extra key still fails loudly)."""
    missing = {a: s for a, s in tied_aliases(module).items() if a not in state and s in state}
    return {**state, **{alias: state[source] for alias, source in missing.items()}}


def full_tensor(value: Tensor, dtype: torch.dtype | None) -> Tensor:
    # Cast first: under FSDP2 each rank casts its own shard and the all-gather moves the
    # smaller dtype (half the bytes for bf16).
    tensor = value.detach() if dtype is None else value.detach().to(dtype)
    full = getattr(tensor, "full_tensor", None)  # a DTensor shard under FSDP2
    if callable(full):
        tensor = full()
    return tensor


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (FSDP2 load: only rank 0 reads the files)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -- full (unsharded) state, for checkpoints ----------------------------------------------------

def full_model_state(module: nn.Module, mode: Mode) -> dict[str, Any]:
    """The model's full state (meaningful on rank 0 under FSDP2, gathered to the host)."""
    if mode != "fsdp2":
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                         mode: Mode) -> dict[str, Any]:
    """The optimizer's full (unsharded) state; meaningful on rank 0."""
    if mode != "fsdp2":
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(module: nn.Module, optimizer: torch.optim.Optimizer, mode: Mode,
                    model_state: dict[str, Any], optim_state: dict[str, Any], *,
                    strict: bool) -> None:
    """Load full states (under FSDP2 rank 0's, broadcast). `strict`: every weight given (a
    LoRA checkpoint gives the adapter's alone: the base is built from model.path)."""
    if model_state and strict:
        model_state = with_tied_aliases(model_state, module)
    if mode != "fsdp2":
        result = module.load_state_dict(model_state, strict=strict)
        assert not result.unexpected_keys, result.unexpected_keys
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(module, model_state, options=opts)
    set_optimizer_state_dict(module, optimizer, optim_state, options=opts)
