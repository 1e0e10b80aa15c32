"""The tiny job's ingredients (kuberl_trainer.tiny): tokenizer, data, build and its cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer

from kuberl_trainer.tiny import data, tokenizer as tok
from kuberl_trainer.tiny.build import (
    EVAL_FILE,
    MANIFEST,
    MODEL_DIR,
    TOKENIZER_DIR,
    TRAIN_FILE,
    BuildConfig,
    build,
)

# Few SFT steps and a small eval set keep a build to a few seconds on 2 cores.
QUICK = BuildConfig(sft_steps=3, n_eval=32, eval_samples=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    build(out, QUICK, log=lambda _: None)
    return out


def test_vocabulary_is_fourteen_symbols() -> None:
    assert len(tok.VOCAB) == 14
    assert tok.make_tokenizer().vocab_size == 14


def test_tokenizer_round_trips_every_symbol(tmp_path: Path) -> None:
    tok.save(tok.make_tokenizer(), tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = tok.SYMBOLS + tok.SYMBOLS[::-1]
    ids = loaded.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, no bos/eos added
    assert [loaded.decode([i]) for i in ids] == list(text)
    assert loaded.decode(ids) == text
    assert loaded.eos_token_id == tok.VOCAB[tok.EOS] and loaded.pad_token_id == tok.VOCAB[tok.PAD]
    assert loaded.decode([*ids, loaded.eos_token_id], skip_special_tokens=True) == text


def test_unknown_characters_are_an_error_not_dropped() -> None:
    with pytest.raises(Exception):  # noqa: B017 - tokenizers raises its own exception type
        tok.make_tokenizer().encode("1 + 2", add_special_tokens=False)


def test_split_is_deterministic_disjoint_and_complete() -> None:
    train, held_out = data.split(seed=0, n_eval=500)
    assert data.split(seed=0, n_eval=500) == (train, held_out)
    assert data.split(seed=1, n_eval=500)[1] != held_out
    assert len(held_out) == 500 and len(train) + len(held_out) == 90 * 90
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}


def test_records_are_prompt_and_label() -> None:
    assert data.Problem(23, 58).record() == {"prompt": "23+58=", "label": "81"}
    assert data.Problem(99, 99).label == "198"


def test_build_writes_an_offline_loadable_model(built: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = str(built / MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # len() counts added tokens too: a 15th (e.g. Qwen2Tokenizer's default unk) would index
    # past the model's embedding.
    assert model.config.vocab_size == len(tokenizer) == 14
    ids = tokenizer.encode(tok.SYMBOLS, add_special_tokens=False)
    assert ids == [tok.VOCAB[c] for c in tok.SYMBOLS]
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == tok.SYMBOLS
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 0.8e6
    ids = tokenizer("23+58=", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), str)
    assert AutoTokenizer.from_pretrained(str(built / TOKENIZER_DIR)).vocab_size == 14


def test_build_record_and_data_files(built: Path) -> None:
    record = json.loads((built / MANIFEST).read_text())
    assert record["config"] == QUICK.key()
    assert 0.0 <= record["greedy_accuracy"] <= 1.0 and 0.0 <= record["sampled_accuracy"] <= 1.0
    train = data.read_jsonl(built / TRAIN_FILE)
    held_out = data.read_jsonl(built / EVAL_FILE)
    assert len(held_out) == QUICK.n_eval and len(train) == 8100 - QUICK.n_eval
    assert set(train[0]) == {"prompt", "label"}


def test_a_complete_build_is_reused(built: Path) -> None:
    weights = built / MODEL_DIR / "model.safetensors"
    before = weights.stat().st_mtime_ns
    messages: list[str] = []
    build(built, QUICK, log=messages.append)
    assert weights.stat().st_mtime_ns == before
    assert messages and "reusing" in messages[0]


def test_other_parameters_or_a_missing_file_rebuild(tmp_path: Path) -> None:
    build(tmp_path, QUICK, log=lambda _: None)
    first = _digest(tmp_path / MODEL_DIR / "model.safetensors")
    (tmp_path / TRAIN_FILE).unlink()
    messages: list[str] = []
    build(tmp_path, QUICK, log=messages.append)
    assert (tmp_path / TRAIN_FILE).is_file() and "reusing" not in messages[0]
    # Same seed and steps, built again from scratch: the same weights, byte for byte.
    assert _digest(tmp_path / MODEL_DIR / "model.safetensors") == first
    other = BuildConfig(sft_steps=QUICK.sft_steps, n_eval=QUICK.n_eval,
                        eval_samples=QUICK.eval_samples, seed=1)
    build(tmp_path, other, log=messages.append)
    assert json.loads((tmp_path / MANIFEST).read_text())["config"]["seed"] == 1
    assert _digest(tmp_path / MODEL_DIR / "model.safetensors") != first


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
