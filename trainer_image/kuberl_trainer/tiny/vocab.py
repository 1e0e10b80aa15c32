"""The tiny tokenizer's 14 symbols and their ids, with no import beyond the standard library
(the tool task's calculator needs the id of "=" in an environment server without torch)."""

from __future__ import annotations

PAD = "<pad>"
EOS = "<eos>"
SYMBOLS = "0123456789+="
# pad is id 0 so zero-initialised buffers read as padding; no bos: prompts are short and fixed
# in form, and Qwen2 needs none.
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate([PAD, EOS, *SYMBOLS])}
EQUALS_ID = VOCAB["="]
