"""The SFT warm start: teacher forcing on "prompt + answer + eos", loss on answer tokens only.

GRPO needs a policy that is sometimes right: from scratch every reward is 0, so every group
advantage is 0 and nothing is learned. The step count sets how far the warm start goes (DESIGN:
greedy accuracy about 0.5 leaves RL room to show a climb).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kuberl_trainer.tiny.data import Problem

IGNORE = -100  # HF's label value for "no loss here"


def encode(tokenizer: PreTrainedTokenizerBase,
           problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), each [N, L], right-padded; labels are IGNORE on the
    prompt and padding, so the loss covers the answer digits and eos."""
    eos = tokenizer.eos_token_id
    assert isinstance(eos, int)
    rows = []
    for p in problems:
        prompt = tokenizer.encode(p.prompt, add_special_tokens=False)
        answer = [*tokenizer.encode(p.label, add_special_tokens=False), eos]
        rows.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    assert isinstance(pad, int)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
    return ids, (ids != pad).long(), labels


def train(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[Problem],
          *, steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """`steps` AdamW steps on random batches (with replacement) of `problems`; the losses."""
    ids, attention, labels = encode(tokenizer, problems)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        pick = torch.randint(len(problems), (batch_size,), generator=generator)
        loss = model(input_ids=ids[pick], attention_mask=attention[pick],
                     labels=labels[pick]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.train(False)  # eval mode; `eval()` is untyped in transformers
    return losses
