"""The SFT warm start: teacher forcing on "prompt + answer + eos", loss on answer tokens only
(the tool variant's sequences: tool.py).

GRPO needs a policy that is sometimes right: from scratch every reward is 0, so every group
advantage is 0 and nothing is learned. The step count sets how far the warm start goes (DESIGN:
greedy accuracy about 0.5 leaves RL room to show a climb).
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kuberl_trainer.tiny.data import Problem
from kuberl_trainer.tiny.tool import ToolProblem

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Row = tuple[list[int], list[int]]  # (ids, labels)

IGNORE = -100  # HF's label value for "no loss here"


def encode(tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> Tensors:
    """(input_ids, attention_mask, labels), each [N, L], right-padded; labels are IGNORE on the
    prompt and padding, so the loss covers the answer digits and eos."""
    rows = []
    for p in problems:
        prompt = tokenizer.encode(p.prompt, add_special_tokens=False)
        answer = _answer(tokenizer, p.label)
        rows.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    return pad_rows(tokenizer, rows)


def tool_rows(tokenizer: PreTrainedTokenizerBase, problems: list[ToolProblem], *,
              read_fraction: float, seed: int) -> Tensors:
    """The tool variant's sequences (tool.py): a `read_fraction` of the problems (picked by
    `seed`) as "prompt = result= answer<eos>" with the call and the result out of the loss,
    the rest as "prompt answer<eos>"."""
    pick = random.Random(seed)
    rows: list[Row] = []
    for p in problems:
        prompt = tokenizer.encode(p.prompt, add_special_tokens=False)
        answer = _answer(tokenizer, p.label)
        read = tokenizer.encode(f"={p.label}=", add_special_tokens=False) \
            if pick.random() < read_fraction else []
        rows.append((prompt + read + answer, [IGNORE] * (len(prompt) + len(read)) + answer))
    return pad_rows(tokenizer, rows)


def _answer(tokenizer: PreTrainedTokenizerBase, label: str) -> list[int]:
    eos = tokenizer.eos_token_id
    assert isinstance(eos, int)
    return [*tokenizer.encode(label, add_special_tokens=False), eos]


def pad_rows(tokenizer: PreTrainedTokenizerBase, rows: list[Row]) -> Tensors:
    """Rows of (ids, labels) as right-padded [N, L] tensors and their attention mask."""
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    assert isinstance(pad, int)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
    return ids, (ids != pad).long(), labels


def train(model: PreTrainedModel, tensors: Tensors, *, steps: int, batch_size: int, lr: float,
          seed: int, router_aux_loss: bool = False) -> list[float]:
    """`steps` AdamW steps on random batches (with replacement) of the encoded rows (`encode`,
    `tool_rows`); the losses. `router_aux_loss` (an HF MoE model): the loss adds the config's
    router_aux_loss_coef times transformers' load-balancing loss, as MoE pre-training does."""
    ids, attention, labels = tensors
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    extra = {"output_router_logits": True} if router_aux_loss else {}
    for _ in range(steps):
        pick = torch.randint(len(ids), (batch_size,), generator=generator)
        loss = model(input_ids=ids[pick], attention_mask=attention[pick],
                     labels=labels[pick], **extra).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.train(False)  # eval mode; `eval()` is untyped in transformers
    return losses
