"""Sampling for the reference engine: SGLang's sampling params, token choice, logprobs, stops.

Semantics follow SGLang (python/sglang/srt/sampling/sampling_params.py, layers/sampler.py):
- temperature < 1e-6 means greedy; SGLang then uses temperature 1 and top_k 1.
- Logprobs (`output_token_logprobs`) are those of the chosen token under
  softmax(logits / temperature) over the whole vocabulary: temperature-scaled, *before* top-k /
  top-p truncation and renormalisation (SGLang's default). Greedy tokens thus get their logprob
  under the raw (temperature 1) distribution. With SGLANG_RETURN_ORIGINAL_LOGPROB set, SGLang
  returns raw-logit logprobs instead; the engine honours the same variable.
  This is what the trainer's `logprobs` (temperature-scaled) must match for on-policy ratios.
- top_p keeps the smallest prefix of tokens sorted by probability whose mass before each kept
  token is <= top_p; top_k keeps the k most likely; -1 (or 1<<30) means all.
- Finish order per generated token, as SGLang checks it: length (max_new_tokens reached) first,
  then an EOS / stop_token_ids match, then a stop string in the decoded text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30

# Fields the reference engine implements.
_SUPPORTED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
              "ignore_eos", "sampling_seed", "skip_special_tokens", "no_stop_trim",
              "spaces_between_special_tokens", "custom_params"}
# SGLang fields accepted only at their defaults: a non-default value would silently sample
# differently from SGLang, so it is an error instead.
_DEFAULT_ONLY: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "stop_regex": None, "logit_bias": None, "stream_interval": None,
}
# custom_params only reaches a request's custom logit processor (SGLang passes it nowhere
# else); the reference engine refuses custom_logit_processor, so custom_params is accepted and
# has no effect, exactly as in SGLang without a processor (slime sends it whenever top_p < 1).


@dataclass(frozen=True)
class Sampling:
    # None: as many as the context allows (SGLang's null); the engine resolves it per prompt.
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def _number(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"sampling_params.{key} must be a number, got {value!r}")
    return float(value)


def _integer(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def _flag(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    """SGLang's booleans: absent or null means the default."""
    value = raw.get(key)
    return default if value is None else bool(value)


def parse_sampling(raw: Mapping[str, Any] | None) -> Sampling:
    """Validate SGLang-named sampling params; ValueError with the offending field.
    A null value means the field's SGLang default (SamplingParams.__post_init__), and a null
    max_new_tokens means "up to the context length" (the scheduler's 1 << 30, clamped)."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _SUPPORTED - set(_DEFAULT_ONLY))
    if unknown:
        raise ValueError(f"unknown sampling_params {unknown} (SGLang spells the seed "
                         "'sampling_seed')" if "seed" in unknown else
                         f"unknown sampling_params {unknown}")
    for key, default in _DEFAULT_ONLY.items():
        if key in raw and raw[key] is not None and raw[key] != default:
            raise ValueError(f"sampling_params.{key}={raw[key]!r} is not supported by the "
                             f"reference engine (only the default {default!r})")
    max_new: int | None = 128
    if "max_new_tokens" in raw:
        max_new = None if raw["max_new_tokens"] is None else _integer(raw, "max_new_tokens", 0)
    temperature = _number(raw, "temperature", 1.0)
    top_p = _number(raw, "top_p", 1.0)
    top_k = _integer(raw, "top_k", -1)
    if max_new is not None and max_new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")
    if not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a non-negative finite number, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == -1:
        top_k = TOP_K_ALL
    if top_k < 1:
        raise ValueError(f"top_k must be -1 (all) or >= 1, got {top_k}")
    stop = raw.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    stop_ids = [t for t in raw.get("stop_token_ids") or () if t is not None]  # as SGLang
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ValueError(f"stop_token_ids must be integers, got {stop_ids!r}")
    seed = raw.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"sampling_seed must be an integer, got {seed!r}")
    if temperature < SAMPLING_EPS:  # SGLang's greedy normalisation
        temperature, top_k = 1.0, 1
    return Sampling(max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k,
                    stop=stop, stop_token_ids=frozenset(stop_ids),
                    ignore_eos=_flag(raw, "ignore_eos", False), seed=seed,
                    skip_special_tokens=_flag(raw, "skip_special_tokens", True),
                    no_stop_trim=_flag(raw, "no_stop_trim", False),
                    spaces_between_special_tokens=_flag(raw, "spaces_between_special_tokens",
                                                        True))


class UniformDraws:
    """One request's U(0,1) draws for sampling, one per generated token, from its own seeded
    generator. Drawn in blocks (one torch call per block, not per token: at small model sizes
    the per-token calls cost more than the sampling). The block size depends only on the
    request's own max_new_tokens, so its draws never depend on which requests share a batch."""

    BLOCK = 64

    def __init__(self, seed: int, max_new_tokens: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.size = max(1, min(max_new_tokens, self.BLOCK))
        self.buffer: list[float] = []
        self.pos = 0

    def next(self) -> float:
        if self.pos == len(self.buffer):
            self.buffer = torch.rand(self.size, generator=self.generator,
                                     dtype=torch.float64).tolist()
            self.pos = 0
        self.pos += 1
        return self.buffer[self.pos - 1]


def choose_tokens(logits: torch.Tensor, rows: Sequence[Sampling],
                  draws: Sequence[UniformDraws], *,
                  original_logprob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits[B, V] (float32) -> (tokens[B] int64, logprobs[B] float32).

    One uniform draw per sampled row from that row's own stream (inverse CDF over the
    truncated, sorted distribution), so a row's tokens depend only on its seed and its
    logits, never on which other requests share the batch."""
    device = logits.device
    temps = torch.tensor([r.temperature for r in rows], dtype=logits.dtype, device=device)
    scaled_logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sample_rows = [i for i, r in enumerate(rows) if not r.greedy]
    if sample_rows:
        idx = torch.tensor(sample_rows, device=device)
        probs = scaled_logp[idx].exp()
        sorted_p, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=device)[None, :]
        top_k = torch.tensor([rows[i].top_k for i in sample_rows], device=device)[:, None]
        top_p = torch.tensor([rows[i].top_p for i in sample_rows], dtype=probs.dtype,
                             device=device)[:, None]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        keep = (ranks < top_k) & (mass_before <= top_p)
        kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        cdf = kept.cumsum(dim=-1)
        u = torch.tensor([draws[i].next() for i in sample_rows], dtype=cdf.dtype,
                         device=device) * cdf[:, -1]
        pick = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=cdf.shape[-1] - 1)
        tokens[idx] = order.gather(1, pick).squeeze(1)
    source = torch.log_softmax(logits, dim=-1) if original_logprob else scaled_logp
    logprobs = source.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


@dataclass
class Finish:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None

    def to_json(self, max_new_tokens: int) -> dict[str, Any]:
        if self.type == "length":
            return {"type": "length", "length": max_new_tokens}
        if self.type == "abort":
            return {"type": "abort", "message": self.message or "aborted"}
        return {"type": "stop", "matched": self.matched}


def check_finish(output_ids: Sequence[int], p: Sampling, eos_ids: frozenset[int],
                 tail_text: str) -> Finish | None:
    """After appending a token: SGLang's order (length, token match, stop string).
    `tail_text` is the decoded end of the completion, long enough to contain any stop string."""
    if p.max_new_tokens is not None and len(output_ids) >= p.max_new_tokens:
        return Finish("length")
    last = output_ids[-1]
    if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
        return Finish("stop", matched=last)
    for stop in p.stop:
        if stop in tail_text:
            return Finish("stop", matched=stop)
    return None
