"""The reference engine's scoring model (`--is-embedding`): a `*ForSequenceClassification`
checkpoint scored the way SGLang 0.5.6 serves one on /classify.

SGLang's LlamaForSequenceClassification, Qwen2ForSequenceClassification and
Qwen3ForSequenceClassification (sglang/srt/models/*_classification.py) run the decoder over
the whole input, apply the `score` head to every position and keep the LAST position's
outputs (`Pooler(PoolingType.LAST, normalize=False)`): num_labels raw numbers, no softmax,
sigmoid or normalisation. The last position is the input's last token, whatever it is: unlike
HF's own forward, which pools at the last token that is not `pad_token_id`, so the two differ
for an input ending in the pad token. This module does what SGLang does (the decoder, then the
head on the last token), with the decoder and head of the HF checkpoint.

A batch is one forward of left-padded rows (an attention mask and per-row positions, as the
generation engine's prefill: kv_batch.py), so the last column is every row's last real token
and each row's numbers are what it gets alone, up to float rounding; rows are grouped by
length into forwards of at most `max_batch_size` rows and `max_prefill_tokens` padded tokens
(a longer row goes alone), as SGLang's prefill budget splits a batch.

Not thread-safe: every call that touches torch runs on the server's one worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from kuberl_rollout.reference import kv_batch
from kuberl_rollout.reference.engine import DTYPES

# The head SGLang's decoder classification models have (and HF's Llama, Qwen2, Qwen3, Mistral,
# Gemma... *ForSequenceClassification): a Linear from the hidden size to num_labels.
HEAD = "score"


class Classifier:
    def __init__(self, model_path: str, *, tokenizer_path: str | None = None,
                 device: str = "cpu", dtype: str = "float32",
                 weight_version: str = "default", max_batch_size: int = 256,
                 max_prefill_tokens: int = 16384) -> None:
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.device = torch.device(device)
        self.weight_version = weight_version
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path,
                                                       local_files_only=True)
        try:
            model, loading = AutoModelForSequenceClassification.from_pretrained(
                model_path, local_files_only=True, dtype=DTYPES[dtype], output_loading_info=True)
        except ValueError as exc:  # (a config it has no class for, a remote-code model)
            raise ValueError(f"--is-embedding: {model_path} is not a checkpoint "
                             f"AutoModelForSequenceClassification loads: {exc}") from None
        if loading["missing_keys"]:  # (HF would start them random: a causal LM's, say)
            raise ValueError(
                f"--is-embedding: {model_path} has no weights for "
                f"{sorted(loading['missing_keys'])[:5]}: not a *ForSequenceClassification "
                "checkpoint (its head would be random)")
        model = cast(Any, model)
        head = getattr(model, HEAD, None)
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(
                f"--is-embedding: {type(model).__name__} has no `{HEAD}` head over the last "
                "token; the reference engine serves decoder *ForSequenceClassification models "
                "(Llama, Qwen2, Qwen3, Mistral...), as SGLang pools them")
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.decoder = self.model.base_model
        self.head = head
        config = self.model.config
        self.num_labels = int(config.num_labels)
        self.vocab_size = int(config.vocab_size)
        self.context_len = int(getattr(config, "max_position_embeddings", 1 << 20))
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None
                          else self.tokenizer.pad_token_id or 0)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype  # type: ignore[no-any-return]

    def tokenize(self, text: str) -> list[int]:
        """SGLang's tokenizer manager tokenizes a text as the tokenizer's default call does
        (special tokens added as the tokenizer adds them)."""
        return list(self.tokenizer(text)["input_ids"])

    def check(self, input_ids: Sequence[Any]) -> list[int]:
        """One input's token ids, checked (ValueError -> HTTP 400): SGLang's context check and
        message (tokenizer_manager._validate_one_request); the rest are the reference engine's
        own (SGLang would fail on the device)."""
        if not input_ids:
            raise ValueError("an input has no tokens")
        bad = [t for t in input_ids
               if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        n = len(input_ids)
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context "
                             f"length ({self.context_len} tokens).")
        return list(input_ids)

    def score(self, rows: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each row's head outputs at its last token (num_labels floats), in the rows' order.
        Rows must be checked (`check`)."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out: list[list[float]] = [[] for _ in rows]
        with torch.inference_mode():
            for group in self._groups([len(rows[i]) for i in order]):
                chosen = [order[j] for j in group]
                for i, values in zip(chosen, self._forward([rows[i] for i in chosen]),
                                     strict=True):
                    out[i] = values
        return out

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        """Consecutive indices of `lengths` (ascending) as forwards within the limits: at most
        max_batch_size rows and max_prefill_tokens tokens once padded to the longest."""
        groups: list[list[int]] = []
        for j, n in enumerate(lengths):
            if groups and (len(groups[-1]) < self.max_batch_size
                           and n * (len(groups[-1]) + 1) <= self.max_prefill_tokens):
                groups[-1].append(j)
            else:
                groups.append([j])
        return groups

    def _forward(self, rows: list[Sequence[int]]) -> list[list[float]]:
        ids, mask = kv_batch.prefill_inputs(rows, self.pad_id, self.device)
        lengths = [len(r) for r in rows]
        attention, positions = kv_batch.model_mask(mask, min(lengths) != max(lengths))
        hidden = self.decoder(input_ids=ids, attention_mask=attention, position_ids=positions,
                              use_cache=False).last_hidden_state
        # Left-padded: the last column is every row's last token (SGLang's LAST pooling).
        values: list[list[float]] = self.head(hidden[:, -1, :]).float().tolist()
        return values
