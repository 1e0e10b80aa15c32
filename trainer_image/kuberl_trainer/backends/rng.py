"""Capture and restore every random number generator a training process uses.

Saved per rank with a checkpoint so a resumed job draws the same random numbers (dropout,
sampling in the trainer) as an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    # A checkpoint from a GPU job restored on CPU (or on fewer GPUs) skips what has no home.
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(saved)


def _numpy_state() -> tuple[str, list[int], int, int, float]:
    """numpy's legacy global state with the key array as a list: plain Python values, so
    the file loads with ``torch.load(weights_only=True)`` (no unpickling of numpy types)."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)
