"""Token alignment: the shift convention, in one place.

A causal LM's ``logits[:, t]`` is the distribution of the *next* token, ``input_ids[:, t+1]``.
The trainer stores everything aligned to ``input_ids`` positions (see ``base.py``), so the
log-prob of token ``t`` comes from ``logits[:, t-1]`` and position 0, which nothing predicts,
gets 0. The backends run packed rows, where the same shift stays inside each sequence
(``packing.next_token_targets`` and ``packing.to_rows``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def response_mask(loss_mask: Tensor) -> Tensor:
    """``loss_mask[B, T]`` as float with column 0 cleared (it has no log-prob to train)."""
    mask = loss_mask.to(torch.float32).clone()
    mask[:, 0] = 0.0
    return mask
