"""LoRA on the fsdp backend's policy (``training.lora``; docs/lora.md).

PEFT wraps the HF model: every targeted linear layer gets ``lora_A`` (r x in) and ``lora_B``
(out x r, zero at the start), only they train, and ``disable_adapter`` gives the base model
back for the KL reference, with no second copy of the weights.

What leaves the backend is always a plain HF model's view:

- weight sync (``sync: merged``): each targeted weight as ``W + (alpha / r) B A``, computed
  into a new tensor (the base is never merged in place: it must stay the base), the adapter's
  own tensors never sent. The engines load them as a full-weight sync.
- a checkpoint's ``model/``: the same merged weights (an HF directory any reader serves:
  mode eval, the engines, the learning tests), and ``adapter/``: the adapter alone, a PEFT
  directory (``PeftModel.from_pretrained(base, dir)``), which a resumed run loads onto the base
  from ``model.path``.

``KUBERL_TEST_LORA_UNMERGED`` (tests only): the export leaves the adapter out, sending the base
weights: the silent failure (rollouts from the base while training looks healthy) that the
integration test must be able to catch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import LoraLayer
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import PreTrainedModel

from kuberl_api.spec.lora import LoraSpec

ADAPTER_DIR = "adapter"                      # inside a checkpoint: the PEFT adapter directory
ADAPTER_FILE = "adapter_model.safetensors"   # PEFT's file name in it
ADAPTER = "default"                          # PEFT's name of the (only) adapter
UNMERGED_ENV = "KUBERL_TEST_LORA_UNMERGED"
_PEFT_PREFIX = "base_model.model."           # PeftModelForCausalLM > LoraModel > the HF model


def lora_config(lora: LoraSpec) -> LoraConfig:
    """PEFT's config for the spec: ``targetModules`` as PEFT matches names, default every
    linear layer but the output head (PEFT's "all-linear")."""
    # (PEFT annotates lora_alpha as int; it only divides by it, and a float alpha is fine)
    return LoraConfig(r=lora.rank, lora_alpha=lora.lora_alpha,  # type: ignore[arg-type]
                      lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules or ()) or "all-linear",
                      bias="none", task_type="CAUSAL_LM")


def add_adapter(model: PreTrainedModel, lora: LoraSpec) -> PeftModel:
    """``model`` wrapped with the spec's adapter (fresh, or ``lora.path``'s weights), the base
    frozen, everything in eval mode (no dropout outside ``dropout_on``)."""
    peft_model = get_peft_model(model, lora_config(lora))
    if lora.path is not None:
        load_adapter_state(peft_model, read_adapter(Path(lora.path)),
                           source=f"training.lora.path {lora.path}")
    peft_model.train(False)
    return peft_model


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The adapter's parameters: all the optimizer sees."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def dropout_on(model: nn.Module) -> Iterator[None]:
    """The adapter's dropout active (training forwards only: log-prob passes stay exact)."""
    drops = [m for name, m in model.named_modules() if name.endswith(f"lora_dropout.{ADAPTER}")]
    for m in drops:
        m.train(True)
    try:
        yield
    finally:
        for m in drops:
            m.train(False)


# -- the plain HF model's view -------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One key of a plain HF model's state_dict: its ``name``, the live tensor it comes
    from, and the LoRA layer whose update merges into it (None: sent as it is)."""

    name: str
    value: Tensor
    layer: LoraLayer | None


def hf_entries(model: PeftModel) -> list[Entry]:
    """The keys a plain HF model of this architecture has, in its order, from the PEFT
    model's state_dict: the adapter's tensors left out, ``base_layer.`` dropped from the
    wrapped layers' names, each targeted weight marked for merging (unless the test-only
    ``UNMERGED_ENV`` says to leave the adapter out)."""
    skip_adapter = bool(os.environ.get(UNMERGED_ENV))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    entries = []
    for key, value in model.state_dict(keep_vars=True).items():
        if ".lora_" in key:
            continue
        layer = None
        if ".base_layer." in key:
            prefix, _, leaf = key.rpartition(".base_layer.")
            layer = layers[prefix] if leaf == "weight" and not skip_adapter else None
            key = f"{prefix}.{leaf}"
        entries.append(Entry(key.removeprefix(_PEFT_PREFIX), value, layer))
    return entries


def merged_weight(weight: Tensor, layer: LoraLayer, full: Callable[[Tensor], Tensor]) -> Tensor:
    """``weight + scaling * B @ A`` in float32, a new tensor (``weight``, the full base
    weight, is not touched); ``full`` gathers a (possibly sharded) adapter tensor."""
    a = full(_weight(layer.lora_A[ADAPTER])).float()
    b = full(_weight(layer.lora_B[ADAPTER])).float()
    delta = (b @ a) * float(layer.scaling[ADAPTER])
    if getattr(layer, "fan_in_fan_out", False):  # (GPT-2's Conv1D stores W transposed)
        delta = delta.T
    return weight.float() + delta


def _weight(linear: nn.Module) -> Tensor:
    weight = linear.weight
    assert isinstance(weight, Tensor)
    return weight


# -- the adapter on disk ---------------------------------------------------------------------


def adapter_names(model: PeftModel) -> dict[str, str]:
    """``{name in a PEFT adapter file: the live model's state_dict name}`` for every adapter
    tensor (the file's names drop the adapter's name: ``lora_A.weight``, not
    ``lora_A.default.weight``)."""
    return {key.replace(f".{ADAPTER}.", "."): key for key in model.state_dict()
            if ".lora_" in key}


def save_adapter(model: PeftModel, out: Path, state: dict[str, Tensor]) -> None:
    """A PEFT adapter directory at ``out`` from ``state`` (the adapter's tensors, full, under
    the live model's names): what ``PeftModel.from_pretrained`` loads."""
    model.save_pretrained(str(out), state_dict=state)


def read_adapter(path: Path) -> dict[str, Tensor]:
    """A PEFT adapter directory's tensors, under the file's names."""
    file = path / ADAPTER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no {ADAPTER_FILE} (not a PEFT adapter directory)")
    return load_file(str(file))


def live_adapter_state(model: PeftModel, saved: dict[str, Tensor], *, source: str
                       ) -> dict[str, Tensor]:
    """``saved`` (an adapter file's tensors) under the live model's names; every adapter
    tensor must be there with its shape, and nothing else (a different rank or other target
    modules fail here, naming ``source``)."""
    names = adapter_names(model)
    live = model.state_dict()
    missing = sorted(set(names) - set(saved))
    extra = sorted(set(saved) - set(names))
    if missing or extra:
        raise ValueError(f"{source}: the adapter does not fit training.lora's (rank, "
                         f"targetModules): missing {missing[:3]}, unexpected {extra[:3]}")
    for name, key in names.items():
        if tuple(saved[name].shape) != tuple(live[key].shape):
            raise ValueError(f"{source}: {name} has shape {tuple(saved[name].shape)}, "
                             f"training.lora's adapter {tuple(live[key].shape)} (another rank?)")
    return {names[name]: tensor for name, tensor in saved.items()}


def load_adapter_state(model: PeftModel, saved: dict[str, Tensor], *, source: str) -> None:
    """Copy an adapter file's tensors into an unsharded model (``lora.path`` at build)."""
    state = live_adapter_state(model, saved, source=source)
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys


def adapter_norm(model: nn.Module, *, sharded: bool) -> float:
    """The adapter's global L2 norm (its parameters: the trainable ones). Sharded (FSDP2):
    each rank's squares summed over the ranks (collective)."""
    params = trainable(model)
    local = [getattr(p, "_local_tensor", p).detach().float() for p in params]
    squares = torch.stack([t.pow(2).sum() for t in local]).sum() if local else torch.zeros(())
    if sharded:
        torch.distributed.all_reduce(squares)
    return float(squares.sqrt())


def trainable_count(model: nn.Module) -> int:
    """The adapter's parameter count (a DTensor's numel is its full size)."""
    return sum(p.numel() for p in trainable(model))


def lora_metrics(model: nn.Module, *, sharded: bool) -> dict[str, Any]:
    return {"lora_trainable_params": float(trainable_count(model)),
            "lora_adapter_norm": adapter_norm(model, sharded=sharded)}
