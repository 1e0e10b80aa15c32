"""Batched sampling with a KV cache, returning the sampled tokens' log-probabilities.

Shared by the build's evaluation and bench/tiny_grpo_baseline.py, so the baseline and the
accuracies in build.json count answers the same way. HF `generate` would do, but its per-token
overhead (logits processors, stopping criteria) dominates at this model size and it does not
return temperature-scaled log-probs of the sampled tokens directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Samples:
    """`tokens[B,T]` sampled response ids (pad after eos), `logprobs[B,T]` their log-probs
    under the temperature-scaled policy (0 where masked), `mask[B,T]` 1 up to and including
    eos. T = max_new_tokens."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor


@torch.no_grad()
def sample(model: PreTrainedModel, prompt_ids: torch.Tensor, *, max_new_tokens: int,
           temperature: float, eos_id: int, pad_id: int,
           generator: torch.Generator | None = None) -> Samples:
    """Sample responses for equal-length prompts `prompt_ids[B,P]`; temperature 0 is greedy.

    Equal-length prompts need no attention mask; rows that finished keep being fed `pad_id`
    (cheaper than compacting the batch at 4 tokens) and are masked out.
    """
    batch = prompt_ids.shape[0]
    out = model(input_ids=prompt_ids, use_cache=True)
    done = torch.zeros(batch, dtype=torch.bool)
    tokens, logprobs, masks = [], [], []
    for step in range(max_new_tokens):
        token, logp = _pick(out.logits[:, -1].float(), temperature, generator)
        token = token.masked_fill(done, pad_id)
        masks.append(~done)
        tokens.append(token)
        logprobs.append(logp.masked_fill(done, 0.0))
        done = done | (token == eos_id)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        out = model(input_ids=token[:, None], past_key_values=out.past_key_values,
                    use_cache=True)
    return _pad_to(Samples(torch.stack(tokens, 1), torch.stack(logprobs, 1),
                           torch.stack(masks, 1).long()), max_new_tokens, pad_id)


def _pick(logits: torch.Tensor, temperature: float,
          generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [B] and its log-prob [B] from last-position logits [B,V]."""
    if temperature == 0:
        logp = torch.log_softmax(logits, -1)
        token = logp.argmax(-1)
    else:
        logp = torch.log_softmax(logits / temperature, -1)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return token, logp.gather(1, token[:, None]).squeeze(1)


def _pad_to(s: Samples, length: int, pad_id: int) -> Samples:
    missing = length - s.tokens.shape[1]
    if missing == 0:
        return s
    pad = torch.nn.functional.pad
    return Samples(pad(s.tokens, (0, missing), value=pad_id), pad(s.logprobs, (0, missing)),
                   pad(s.mask, (0, missing)))


def answers(tokenizer: PreTrainedTokenizerBase, samples: Samples) -> list[str]:
    """Decoded responses, eos and padding dropped."""
    rows = (samples.tokens * samples.mask).tolist()
    lengths = samples.mask.sum(1).tolist()
    return [str(tokenizer.decode(row[:n], skip_special_tokens=True))
            for row, n in zip(rows, lengths, strict=True)]


def exact_rewards(responses: list[str], labels: list[str]) -> torch.Tensor:
    """1.0 where the response equals the label (surrounding whitespace ignored), else 0.0."""
    return torch.tensor([float(r.strip() == lab.strip())
                         for r, lab in zip(responses, labels, strict=True)])
