"""The fsdp backend's weights as others read them: weight sync's HF-named buckets, the
adapter LoRA's `sync: adapter` exports, and checkpoints (save, load). A mixin of
``FSDPBackend`` (fsdp.py), kept apart from its training logic."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import PreTrainedModel

from kuberl_api.spec import LoraSpec, RLJobSpec
from kuberl_trainer.backends.buckets import bucketize
from kuberl_trainer.backends.fsdp_models import (
    Mode,
    broadcast_object,
    full_model_state,
    full_optimizer_state,
    full_tensor,
    load_full_state,
)
from kuberl_trainer.backends.hf_files import (
    MODEL_DIR,
    copy_tokenizer,
    keep_source_dtype,
    read_safetensors_dir,
)
from kuberl_trainer.backends.rng import rng_state, set_rng_state
from kuberl_wire import expert_names

if TYPE_CHECKING:
    from peft import PeftModel

LOG = logging.getLogger("kuberl.backend.fsdp")

OPTIM_FILE = "optimizer.pt"   # optimizer + LR scheduler, full (unsharded) state, from rank 0
RNG_FILE = "rng_rank{rank}.pt"


class FSDPWeights:
    """Weight sync's buckets and the checkpoints of an ``FSDPBackend`` (which sets these)."""

    spec: RLJobSpec
    rank: int
    world_size: int
    mode: Mode
    module: nn.Module
    lora: LoraSpec | None
    optimizer: torch.optim.Optimizer
    scheduler: Any

    @property
    def _peft(self) -> PeftModel:
        from peft import PeftModel

        assert isinstance(self.module, PeftModel), "training.lora is not set"
        return self.module

    # -- weights -----------------------------------------------------------------------------

    def named_tensor_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                             tied_aliases: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
        """Buckets of ``(name, tensor)`` covering ``module.state_dict()`` of the HF model.

        Names are exactly a plain HF model's ``state_dict()`` keys (no DDP ``module.``
        prefix: it walks the unwrapped module). Tied weights: a tied model's state_dict holds
        both ``model.embed_tokens.weight`` and ``lm_head.weight`` (one tensor). Only the
        first name of each tied group is yielded — the keys ``save_pretrained`` writes, what
        weight sync sends (engines re-tie on load) — unless ``tied_aliases``: then both, so
        ``load_state_dict(strict=True)`` accepts the result.

        Tensors are on the training device, in the training dtype (fp32) unless ``dtype`` is
        given; the single/DDP ones in the training dtype share storage with the live
        weights: read, don't write. Under FSDP2 every rank must iterate (each tensor is an
        all-gather).

        With LoRA, the same names and shapes, each targeted weight merged (``lora.py``): the
        engines load them as any full-weight sync, the adapter's own tensors are not sent.

        A mixture-of-experts model's fused expert parameters go out one matrix per expert,
        in the checkpoint's names (``kuberl_wire.expert_names``), which SGLang's MoE loaders
        read; with ``tied_aliases`` (a ``load_state_dict`` of this very model) they stay
        fused.
        """
        named = self._named_full_tensors(tied_aliases, dtype)
        if not tied_aliases:
            named = (part for name, tensor in named for part in expert_names.split(name, tensor))
        return bucketize(named, bucket_bytes)

    def _named_full_tensors(self, tied_aliases: bool, dtype: torch.dtype | None,
                            ) -> Iterator[tuple[str, Tensor]]:
        entries = self._hf_entries()                        # live tensors: identity finds ties
        uses = Counter(id(value) for _, value, _ in entries)
        gathered: dict[int, Tensor] = {}                    # only tied tensors are kept
        for name, value, merge in entries:
            key = id(value)
            if key in gathered:
                if tied_aliases:
                    yield name, gathered[key]
                continue
            if merge is None:
                tensor = full_tensor(value, dtype)
            else:  # merged in float32 from the full base weight, then cast
                merged = merge(full_tensor(value, None))
                tensor = merged if dtype is None else merged.to(dtype)
            if uses[key] > 1:
                gathered[key] = tensor
            yield name, tensor

    def _hf_entries(self) -> list[tuple[str, Tensor, Callable[[Tensor], Tensor] | None]]:
        """``(HF name, live tensor, merge)`` for each key of the plain HF model's state_dict;
        ``merge`` (LoRA's targeted weights) turns the full base weight into what is sent."""
        if self.lora is None:
            return [(name, value, None)
                    for name, value in self.module.state_dict(keep_vars=True).items()]
        from kuberl_trainer.backends.lora import hf_entries, merged_weight

        def merger(layer: Any) -> Callable[[Tensor], Tensor]:
            return lambda weight: merged_weight(weight, layer,
                                                lambda t: full_tensor(t, None))

        return [(e.name, e.value, None if e.layer is None else merger(e.layer))
                for e in hf_entries(self._peft)]

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, dir: str | Path) -> None:
        """Collective. ``dir/model/`` (HF dir), ``dir/optimizer.pt``, ``dir/rng_rank<r>.pt``.

        The weights are saved in float32 (the master copy, so a resumed run is exact), but
        config.json keeps the source model's dtype, so engines loading the directory run in
        the dtype the model came in.
        """
        path = Path(dir)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            self._save_lora(path)
            return
        model_state, optim_state = self._full_state()
        if self.rank == 0:
            self._save_hf(path / MODEL_DIR, model_state)
            torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict()},
                       path / OPTIM_FILE)
        torch.save(rng_state(), path / RNG_FILE.format(rank=self.rank))
        self._barrier()  # the caller may mark the checkpoint complete once save returns

    def _save_lora(self, path: Path) -> None:
        """LoRA's checkpoint (``lora.py``): ``model/``, the merged weights (servable as any
        checkpoint's); ``adapter/``, the PEFT adapter (what a resumed run loads onto the
        base); the optimizer (the adapter's state only) and RNG as without LoRA."""
        from kuberl_trainer.backends.lora import save_adapter

        adapter = self._full_adapter()
        merged = {name: t.cpu() for name, t in self._named_full_tensors(False, None)}
        optim_state = self._full_optimizer_state()
        if self.rank == 0:
            from kuberl_trainer.backends.lora import ADAPTER_DIR

            self._save_hf(path / MODEL_DIR, merged)
            save_adapter(self._peft, path / ADAPTER_DIR, adapter)
            torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict()},
                       path / OPTIM_FILE)
        torch.save(rng_state(), path / RNG_FILE.format(rank=self.rank))
        self._barrier()

    def _full_adapter(self) -> dict[str, Tensor]:
        """The adapter's whole tensors on the CPU, live names (collective under FSDP2)."""
        return {name: full_tensor(p, None).cpu()
                for name, p in self.module.named_parameters() if p.requires_grad}

    def export_adapter(self, out: Path) -> None:
        """Collective: the adapter as a PEFT directory at ``out`` (rank 0 writes; sync:
        adapter), float32 as trained."""
        from kuberl_trainer.backends.lora import save_adapter

        adapter = self._full_adapter()
        if self.rank == 0:
            save_adapter(self._peft, out, adapter)

    def load(self, dir: str | Path) -> None:
        """Collective. Restore weights, optimizer, scheduler and this rank's RNG state. With
        LoRA the weights are the base (model.path, built already) and the checkpoint's
        adapter."""
        path = Path(dir)
        reads = self.mode != "fsdp2" or self.rank == 0     # FSDP2: rank 0 reads, broadcasts
        model_state = (self._read_weights(path) if reads else {})
        saved = torch.load(path / OPTIM_FILE, map_location="cpu") if reads else {}
        self._load_full_state(model_state, saved.get("optimizer", {}))
        scheduler: dict[str, Any] = saved.get("scheduler", {})
        if self.mode == "fsdp2":
            scheduler = broadcast_object(scheduler)
        self.scheduler.load_state_dict(scheduler)
        self._load_rng(path / RNG_FILE.format(rank=self.rank))
        self._barrier()

    @staticmethod
    def _load_rng(file: Path) -> None:
        if file.exists():
            set_rng_state(torch.load(file))
        else:
            LOG.warning("%s missing (saved with fewer ranks?): RNG state not restored", file)

    def _read_weights(self, path: Path) -> dict[str, Tensor]:
        """A checkpoint's weights under the live module's names: all of them, or LoRA's
        adapter alone."""
        if self.lora is None:  # (expert matrices are saved one per expert, trained fused)
            return expert_names.fuse(read_safetensors_dir(path / MODEL_DIR))
        from kuberl_trainer.backends.lora import ADAPTER_DIR, live_adapter_state, read_adapter

        return live_adapter_state(self._peft, read_adapter(path / ADAPTER_DIR),
                                  source=f"checkpoint {path}")

    def _full_optimizer_state(self) -> dict[str, Any]:
        return full_optimizer_state(self.module, self.optimizer, self.mode)

    def _full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return (full_model_state(self.module, self.mode),
                full_optimizer_state(self.module, self.optimizer, self.mode))

    def _load_full_state(self, model_state: dict[str, Any],
                         optim_state: dict[str, Any]) -> None:
        # (LoRA: the adapter's tensors only; the base is built)
        load_full_state(self.module, self.optimizer, self.mode, model_state, optim_state,
                        strict=self.lora is None)

    def _save_hf(self, out: Path, state: dict[str, Tensor]) -> None:
        hf = self._peft.get_base_model() if self.lora is not None else self.module
        assert isinstance(hf, PreTrainedModel)
        hf.save_pretrained(out, state_dict=state)
        keep_source_dtype(Path(self.spec.model.path) / "config.json", out / "config.json")
        copy_tokenizer(self.spec, out)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
