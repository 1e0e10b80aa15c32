"""Hugging Face checkpoint directories as the backends read and write them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import load_file
from torch import Tensor

if TYPE_CHECKING:
    from kuberl_api.spec import RLJobSpec

MODEL_DIR = "model"  # inside a checkpoint: an HF directory (config.json + safetensors)
# Copied next to the saved weights so the checkpoint directory is servable on its own.
TOKENIZER_GLOBS = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template*")


def read_safetensors_dir(path: Path) -> dict[str, Tensor]:
    """Every tensor of an HF directory's ``*.safetensors`` files (one file or shards)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def keep_source_dtype(source_config: Path, saved_config: Path) -> None:
    """save_pretrained records the float32 master dtype; restore the source model's."""
    if not source_config.exists():
        return
    source = json.loads(source_config.read_text())
    saved = json.loads(saved_config.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in source:
            saved[key] = source[key]
    saved_config.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def copy_tokenizer(spec: RLJobSpec, out: Path) -> None:
    """The job's tokenizer files (``model.tokenizer``, else the model's own) into ``out``."""
    source = Path(spec.model.tokenizer or spec.model.path)
    for pattern in TOKENIZER_GLOBS:
        for f in source.glob(pattern):
            if f.is_file():
                shutil.copy2(f, out / f.name)
