"""LoRA adapters in the reference engine: PEFT adapter directories read as SGLang 0.5.6 reads
them, and each batch row run under its own adapter.

SGLang's facts mirrored here (its sglang/srt/lora/): an adapter is a PEFT directory whose
adapter_config.json gives r, lora_alpha and target_modules (lora_config.LoRAConfig; a path
that is not a directory is a Hub id, fetched with snapshot_download); its update is scaled by
lora_alpha / r, always (lora.LoRAAdapter: PEFT's use_rslora, rank_pattern and alpha_pattern
are not read, so an rsLoRA adapter is served with alpha / r where PEFT uses alpha / sqrt(r));
embed_tokens and lm_head targets are refused ("Not supported yet"); target module names are
compared after q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj (utils.
get_normalized_target_modules), so an adapter fits when its rank is at most --max-lora-rank
and its normalized targets are among the engine's (mem_pool.can_support).

The math: every targeted linear of the decoder gets a forward hook that adds, for each row
of the batch whose adapter has weights for that linear, scaling * B(A x) to W x. The rows'
adapters are set before each forward (`AdapterSet.select`), in the running batch's row order,
so a batch may mix base rows and any adapters (each row's KV cache is built under its own).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# SGLang's SUPPORTED_LORA_TARGET_MODULES and its "all" (utils/common.py).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "qkv_proj", "gate_up_proj")
ALL_TARGETS = "all"
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
            "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
# A PEFT adapter file's key: [base_model.model.]<module>.lora_A|B[.<adapter name>].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?"
                  r"\.weight$")


def normalized_targets(names: Iterable[str]) -> set[str]:
    """Module names as SGLang compares them: the last dotted part, q/k/v and gate/up stacked."""
    return {_STACKED.get(name.split(".")[-1], name.split(".")[-1]) for name in names}


def engine_targets(flag: Sequence[str]) -> set[str]:
    """--lora-target-modules as SGLang's ServerArgs expands it ("all": every supported one)."""
    return set(SUPPORTED_TARGETS) if ALL_TARGETS in flag else set(flag)


@dataclass(frozen=True)
class LoraRef:
    """SGLang's LoRARef: a unique id per load, so a name re-loaded is a new adapter."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class Adapter:
    ref: LoraRef
    rank: int
    scaling: float
    # module name (the model's) -> (A [r, in], B [out, r]) on the model's device and dtype
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def update_output(success: bool, error_message: str, loaded: dict[str, str] | None
                  ) -> dict[str, Any]:
    """SGLang's LoRAUpdateOutput (the answer of both endpoints) as its HTTP server serializes
    the dataclass: BaseReq's fields first, then success, error_message and the adapters loaded
    (name: path; None when the tokenizer side refused before reaching the adapters)."""
    return {"rid": None, "http_worker_ipc": None, "success": success,
            "error_message": error_message, "loaded_adapters": loaded}


def read_config(path: str) -> dict[str, Any]:
    """adapter_config.json, as SGLang's LoRAConfig reads it (its errors are the answer's)."""
    directory = path
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download  # (offline: the Hub's own error)

        directory = snapshot_download(path, allow_patterns=["*.json"])
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config: dict[str, Any] = json.load(f)
    config["__dir__"] = directory
    if any(module in config["target_modules"] for module in ["embed_tokens", "lm_head"]):
        raise ValueError("Not supported yet")
    return config


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors (safetensors first, else PyTorch files, as SGLang's loader)."""
    from safetensors.torch import load_file

    names = sorted(os.listdir(directory))
    files = [n for n in names if n.endswith(".safetensors")]
    if files:
        return {k: v for n in files for k, v in load_file(os.path.join(directory, n)).items()}
    files = [n for n in names if n.endswith((".bin", ".pt"))]
    if not files:
        raise RuntimeError(f"Cannot find any model weights with `{directory}`")
    out: dict[str, torch.Tensor] = {}
    for n in files:
        out.update(torch.load(os.path.join(directory, n), map_location="cpu",
                              weights_only=True))
    return out


class AdapterSet:
    """The adapters an engine holds (SGLang's LoRAManager: the scheduler side), the hooks that
    apply them, and which adapter each row of the next forward uses. Worker thread only."""

    def __init__(self, model: torch.nn.Module, *, max_lora_rank: int, targets: set[str],
                 max_loras_per_batch: int) -> None:
        self.max_lora_rank = max_lora_rank
        self.targets = normalized_targets(targets)
        self.max_loras_per_batch = max_loras_per_batch
        self.adapters: dict[str, Adapter] = {}  # lora_id -> adapter, in load order
        self._rows: list[Adapter | None] = []
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []
        self.modules: dict[str, torch.nn.Linear] = {}
        # SGLang wraps the decoder layers' linears whose last name is a target (init_lora_
        # modules); their per-projection hooks give its stacked qkv / gate_up results.
        for name, module in model.named_modules():
            if (isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
                    and normalized_targets([name]) <= self.targets
                    and name.split(".")[-1] in SUPPORTED_TARGETS):
                self.modules[name] = module
                module.register_forward_hook(self._hook(name))
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype

    # ---- loading (SGLang's LoRAManager.load_lora_adapter / unload_lora_adapter) ------------

    def loaded(self) -> dict[str, str]:
        return {a.ref.lora_name: a.ref.lora_path for a in self.adapters.values()}

    def answer(self, success: bool, error_message: str = "") -> dict[str, Any]:
        return update_output(success, error_message, self.loaded())

    def load(self, ref: LoraRef) -> dict[str, Any]:
        try:
            config = read_config(ref.lora_path)
            self._validate(ref, config)
            self.adapters[ref.lora_id] = self._read(ref, config)
        except Exception as exc:  # (SGLang answers any failure with its message)
            return self.answer(False, str(exc))
        return self.answer(True)

    def _validate(self, ref: LoraRef, config: dict[str, Any]) -> None:
        for other in self.adapters.values():
            if other.ref.lora_name == ref.lora_name:
                raise ValueError(f"Failed to load LoRA adapter {ref.lora_name} because it is "
                                 "already loaded")
        if (config["r"] > self.max_lora_rank
                or not normalized_targets(config["target_modules"]) <= self.targets):
            raise ValueError(
                f"LoRA adapter {ref.lora_name} with rank {config['r']} is incompatible with the "
                "current LoRA memory pool configuration. Please ensure that the LoRA adapter's "
                "rank is within the configured `--max-lora-rank` and that the target modules "
                "are included in `--lora-target-modules`.")
        pinned = sum(a.ref.pinned for a in self.adapters.values())
        if ref.pinned and pinned >= self.max_loras_per_batch - 1:
            raise ValueError(
                f"Failed to load LoRA adapter {ref.lora_name} as a pinned adapter. It is not "
                "allowed to pin all slots in the LoRA memory pool to avoid starvation for "
                "unpinned adapters and base models. Please increase your "
                "`--max-loras-per-batch` or load it as unpinned LoRA adapters.")

    def _read(self, ref: LoraRef, config: dict[str, Any]) -> Adapter:
        if str(config.get("peft_type", "")).lower() != "lora":
            raise AssertionError(f"peft_type {config.get('peft_type')!r} is not LORA")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in read_weights(config["__dir__"]).items():
            match = _KEY.match(key)
            if match is None:
                continue
            pairs.setdefault(match["module"], {})[match["ab"]] = tensor
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, ab in pairs.items():
            if module not in self.modules:
                raise ValueError(f"LoRA adapter {ref.lora_name}: {module} is not a linear "
                                 f"of the model's decoder layers the engine targets")
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {ref.lora_name}: {module} lacks lora_A or "
                                 "lora_B")
            weights[module] = (ab["A"].to(self._device, self._dtype),
                               ab["B"].to(self._device, self._dtype))
        return Adapter(ref, int(config["r"]), config["lora_alpha"] / config["r"], weights)

    def unload(self, lora_id: str) -> dict[str, Any]:
        del self.adapters[lora_id]
        return self.answer(True)

    # ---- the forward --------------------------------------------------------------------

    def select(self, lora_ids: Sequence[str | None]) -> None:
        """The adapter of each row of the next forwards (None: the base model)."""
        self._rows = [None if i is None else self.adapters[i] for i in lora_ids]
        by_id: dict[str, list[int]] = {}
        for row, adapter in enumerate(self._rows):
            if adapter is not None:
                by_id.setdefault(adapter.ref.lora_id, []).append(row)
        whole = len(by_id) == 1 and all(a is not None for a in self._rows)
        self._groups = [
            (self.adapters[i], None if whole else torch.tensor(rows, device=self._device))
            for i, rows in by_id.items()]

    def _hook(self, name: str) -> Any:
        def add_lora(_: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                     output: torch.Tensor) -> torch.Tensor | None:
            if not self._groups:
                return None
            x = inputs[0]
            for adapter, rows in self._groups:
                ab = adapter.weights.get(name)
                if ab is None:
                    continue
                a, b = ab
                if rows is None:  # every row: no gather
                    output = output + adapter.scaling * ((x @ a.T) @ b.T)
                else:
                    delta = adapter.scaling * ((x.index_select(0, rows) @ a.T) @ b.T)
                    output = output.index_add(0, rows, delta)
            return output

        return add_lora
