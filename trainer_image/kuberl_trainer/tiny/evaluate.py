"""Accuracy of the tiny model on addition problems, greedy or sampled."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kuberl_trainer.tiny.data import Problem
from kuberl_trainer.tiny.sampling import answers, exact_rewards, sample
from kuberl_trainer.tiny.tool import ToolProblem

MAX_NEW_TOKENS = 4  # up to 3 answer digits + eos


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> torch.Tensor:
    """[B, P] ids of equal-length prompts (the sampler relies on there being no padding)."""
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    if len({len(r) for r in rows}) > 1:
        raise ValueError("prompts must tokenize to equal lengths")
    return torch.tensor(rows, dtype=torch.long)


def accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
             problems: list[Problem] | list[ToolProblem], *, temperature: float = 0.0,
             n_samples: int = 1, seed: int = 0, batch_prompts: int = 256) -> float:
    """Mean exact-match reward over `n_samples` responses per problem (temperature 0: greedy)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos, int) and isinstance(pad, int)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for start in range(0, len(problems), batch_prompts):
        chunk = [p for p in problems[start:start + batch_prompts] for _ in range(n_samples)]
        samples = sample(model, prompt_ids(tokenizer, [p.prompt for p in chunk]),
                         max_new_tokens=MAX_NEW_TOKENS, temperature=temperature,
                         eos_id=eos, pad_id=pad, generator=generator)
        rewards = exact_rewards(answers(tokenizer, samples), [p.label for p in chunk])
        total += float(rewards.sum())
    return total / (len(problems) * n_samples)


@torch.no_grad()
def sequence_logprob(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     prefixes: list[str], continuations: list[str]) -> torch.Tensor:
    """[N] log-probability at temperature 1 of each continuation's tokens after its prefix
    (exact: one forward pass per length group, no sampling)."""
    rows = [(tokenizer.encode(p, add_special_tokens=False),
             tokenizer.encode(c, add_special_tokens=False)) for p, c in zip(
                 prefixes, continuations, strict=True)]
    out = torch.zeros(len(rows))
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, (p, c) in enumerate(rows):
        by_shape.setdefault((len(p), len(c)), []).append(i)
    for (width, n), index in by_shape.items():
        ids = torch.tensor([rows[i][0] + rows[i][1] for i in index])
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        scored = logp[:, width - 1:width - 1 + n].gather(-1, ids[:, width:, None]).squeeze(-1)
        out[index] = scored.sum(-1)
    return out


def tool_measures(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  problems: list[ToolProblem]) -> dict[str, float]:
    """The tool task's exact measures on `problems` (tool.py): the probability of calling at
    the first response token (`call_prob`), of answering right directly (`direct_accuracy`),
    of copying a true result (`read_accuracy`) and a lying one (`lie_copy`), and the expected
    reward of the calculator's episodes with a truthful and a lying tool. Also the sampled
    and greedy accuracy without the tool (build.json's common fields)."""
    eos = tokenizer.eos_token
    prompts = [p.prompt for p in problems]
    answer = [p.label + eos for p in problems]
    call = sequence_logprob(model, tokenizer, prompts, ["="] * len(problems)).exp()
    direct = sequence_logprob(model, tokenizer, prompts, answer).exp()
    read = sequence_logprob(model, tokenizer, [f"{p.prompt}={p.label}=" for p in problems],
                            answer).exp()
    lie = [str(int(p.label) + 10) for p in problems]
    lie_copy = sequence_logprob(model, tokenizer,
                                [f"{p.prompt}={v}=" for p, v in zip(problems, lie, strict=True)],
                                [v + eos for v in lie]).exp()
    # a lying tool's result is wrong by 10: copying it never equals the label
    return {"call_prob": float(call.mean()), "direct_accuracy": float(direct.mean()),
            "read_accuracy": float(read.mean()), "lie_copy": float(lie_copy.mean()),
            "expected_reward_truthful": float((direct + call * read).mean()),
            "expected_reward_lying": float(direct.mean()),
            "greedy_accuracy": accuracy(model, tokenizer, problems),
            "sampled_accuracy": accuracy(model, tokenizer, problems, temperature=1.0,
                                         n_samples=4)}


@torch.no_grad()
def expert_loads(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 problems: list[Problem]) -> list[list[float]]:
    """Per MoE layer, the share of routed (token, slot) pairs each expert takes on the
    problems' "prompt answer<eos>" sequences (padding left out): a router that sends every
    token to the same top-k experts shows k shares of 1/k and zeros."""
    rows = [[*tokenizer.encode(p.prompt + p.label, add_special_tokens=False),
             tokenizer.eos_token_id] for p in problems]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    k = model.config.num_experts_per_tok
    real = mask.reshape(-1).bool()
    loads = []
    for logits in out.router_logits:  # one [B * T, experts] per MoE layer
        chosen = logits[real].topk(k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=logits.shape[-1]).float()
        loads.append([round(float(c), 4) for c in counts / counts.sum()])
    return loads
