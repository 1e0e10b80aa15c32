"""Tiny PEFT LoRA adapters for the tiny model (tiny_model.py), built locally: what a trainer
would send an engine's /load_lora_adapter.

`build_tiny_lora(model_dir, out_dir, ...)` wraps the model with PEFT, gives lora_B random
non-zero values (PEFT starts it at zero, which would leave the model unchanged, so tests could
not tell an adapter applied from one ignored) and saves the adapter directory
(adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

DEFAULT_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def build_tiny_lora(model_dir: Path, out_dir: Path, *, rank: int = 4, alpha: int = 8,
                    targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 1,
                    scale: float = 0.3) -> Path:
    """A PEFT adapter of `model_dir` in `out_dir` (created); returns it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha,
                                                  target_modules=list(targets),
                                                  lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir))
    return out_dir
