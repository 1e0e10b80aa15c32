"""A 14-symbol character tokenizer: pad, eos, the ten digits, '+' and '='.

Built with the `tokenizers` library and saved as a `PreTrainedTokenizerFast` directory, so the
trainer, the reference engine and `AutoTokenizer.from_pretrained(dir)` load it offline like any
HF tokenizer. A WordLevel model over single characters (rather than BPE with no merges) makes
an out-of-vocabulary character an error instead of a silently dropped one.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kuberl_trainer.tiny.vocab import EOS, PAD, SYMBOLS, VOCAB

__all__ = ["EOS", "PAD", "SYMBOLS", "VOCAB", "make_tokenizer", "save"]


def _backend() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=None))
    # Every character is its own token ("isolated" keeps each match as a piece).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse joins decoded tokens without the spaces WordLevel would put between them.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, EOS])
    return tok


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer object; `save(dir)` writes it for `AutoTokenizer`."""
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=_backend(),
        pad_token=PAD,
        eos_token=EOS,
        # Left padding is what batched generation needs (prompts here are equal-length anyway).
        padding_side="left",
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )


def save(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    tokenizer.save_pretrained(str(out))
    _declare_no_unk(out / "tokenizer_config.json")


def _declare_no_unk(config_path: Path) -> None:
    """Write `"unk_token": null` into tokenizer_config.json.

    Next to a qwen2 config.json, AutoTokenizer loads Qwen2Tokenizer (transformers overrides the
    saved tokenizer_class for qwen2), whose default unk_token "<|endoftext|>" would be added as
    a 15th token, outside the model's 14-row embedding. save_pretrained omits None values, so
    the explicit null is written here.
    """
    config = json.loads(config_path.read_text())
    config["unk_token"] = None
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
