"""torch dtype <-> the dtype strings of SGLang's weight-update requests ("bfloat16", ...).

SGLang resolves a dtype string with `getattr(torch, name)`, so the names are torch's attribute
names without the "torch." prefix. An explicit table (not getattr) keeps a typo or an unsupported
dtype a clear error on the sending side instead of a confusing one on the engine.
"""

from __future__ import annotations

import torch

_BY_NAME: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in _BY_NAME.items()}


def dtype_to_str(dtype: torch.dtype) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no weight-sync name") from None


def str_to_dtype(name: str) -> torch.dtype:
    """Accepts "bfloat16" and, leniently, "torch.bfloat16" (str(torch.bfloat16))."""
    key = name.removeprefix("torch.")
    try:
        return _BY_NAME[key]
    except KeyError:
        known = ", ".join(sorted(_BY_NAME))
        raise ValueError(f"unknown dtype {name!r} (known: {known})") from None
