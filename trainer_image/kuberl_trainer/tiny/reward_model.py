"""The tiny reward model: a Qwen2ForSequenceClassification (one label) whose body is the tiny
policy's, its score head fitted to prefer a correct answer to the add task over a wrong one.

    python -m kuberl_trainer.tiny reward-model --out DIR --policy POLICY_MODEL_DIR

DIR becomes a complete HF checkpoint (config, weights, the tiny tokenizer beside them, as the
policy's model directory has it) that the reference engine serves with --is-embedding, for
`reward.type: model` in tests and the local demo. What it scores is the text the trainer sends
a scalar reward model: prompt + response ("23+58=81"; the tiny tokenizer has no chat template).

The fit (seconds on 2 cores): the body stays frozen; its final hidden state at each text's last
token (what the head sees when served: SGLang's LAST pooling) is computed once for a correct
and a wrong answer to each of `n_pairs` training problems, and the head (hidden -> 1, no bias,
as Qwen2's) is fitted by L-BFGS on the pairwise logistic loss, -log sigmoid(s(correct) -
s(wrong)). Wrong answers are near misses (the correct sum off by 1, 2, 10 or 20) and farther
ones, as a policy's wrong answers are. build.json records the held-out pairwise accuracy (the
tiny build's eval problems, never fitted on). Cached like `tiny build`: reused while build.json
names the same recipe and the same policy weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, Qwen2ForSequenceClassification
from transformers.utils import logging as hf_logging

from kuberl_trainer.tiny import data, tokenizer as tok
from kuberl_trainer.tiny.build import (
    MANIFEST,
    THREADS,
    _no_progress_bars,
    _threads,
    _write_json,
    exclusive,
)

RECIPE = 1  # bump when a code change alters what a build produces
WEIGHTS = "model.safetensors"
REQUIRED = ("config.json", WEIGHTS, "tokenizer.json")
NEAR_MISSES = (1, 2, 10, 20)
FAR_MISS = 50  # a wrong answer off by up to this much, when not a near miss


@dataclass(frozen=True)
class RewardConfig:
    """What determines the built files, with the policy's weights (the cache key)."""

    seed: int = 0
    n_pairs: int = 2000  # training problems, one correct and one wrong answer each
    n_eval: int = 500  # as the tiny build's: its eval problems are the held-out pairs
    l2: float = 1e-3
    recipe: int = RECIPE


def build_reward_model(out: Path, policy: Path, config: RewardConfig = RewardConfig(), *,
                       force: bool = False,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the reward model into `out` from the tiny policy's model directory `policy`
    (`tiny build --out B` writes B/model), unless `out` already holds this build; returns
    build.json's content."""
    key = {**asdict(config), "policy_sha256": _sha256(policy / WEIGHTS)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out.parent / f".{out.name}.lock"):
        if not force and (record := cached(out, key)) is not None:
            log(f"tiny: reusing the reward model in {out}")
            return record
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST).unlink(missing_ok=True)  # incomplete until the build ends
        with _threads(THREADS):
            record = _build(out, policy, config, key)
        _write_json(out / MANIFEST, record)
    log(f"tiny: built the reward model {out}: held-out pairwise accuracy "
        f"{record['heldout_pairwise_accuracy']:.3f}, {record['seconds']:.1f} s")
    return record


def cached(out: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if record.get("config") != key or not all((out / f).is_file() for f in REQUIRED):
        return None
    return record


def _build(out: Path, policy: Path, config: RewardConfig, key: dict[str, Any]
           ) -> dict[str, Any]:
    start = time.perf_counter()
    model = reward_model_from(policy, config.seed)
    tokenizer = tok.make_tokenizer()
    train, held_out = data.split(config.seed, config.n_eval)
    rng = random.Random(config.seed)
    fit_pairs = [(p.prompt + p.label, p.prompt + wrong_answer(p, rng))
                 for p in train[:config.n_pairs]]
    eval_pairs = [(p.prompt + p.label, p.prompt + wrong_answer(p, rng)) for p in held_out]

    def encode(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    fit_gap = _gaps(model, [(encode(c), encode(w)) for c, w in fit_pairs])
    eval_gap = _gaps(model, [(encode(c), encode(w)) for c, w in eval_pairs])
    weight = fit_head(fit_gap, config.l2)
    with torch.no_grad():
        model.score.weight.copy_(weight.unsqueeze(0))
    with _no_progress_bars():
        model.save_pretrained(str(out))
    tok.save(tokenizer, out)
    return {
        "config": key,
        "policy": str(policy),
        "fit_pairs": len(fit_pairs),
        "heldout_pairs": len(eval_pairs),
        "train_pairwise_accuracy": pairwise_accuracy(fit_gap, weight),
        "heldout_pairwise_accuracy": pairwise_accuracy(eval_gap, weight),
        "seconds": round(time.perf_counter() - start, 2),
        "threads": THREADS,
        "torch": torch.__version__,
    }


def reward_model_from(policy: Path, seed: int) -> Qwen2ForSequenceClassification:
    """The policy's body under a one-label score head (seeded; fitted by the caller). Its
    config says what a served reward model needs: the architecture, num_labels 1 and the pad
    token, and no tied LM head (it has none)."""
    config = AutoConfig.from_pretrained(str(policy), local_files_only=True)
    config.architectures = ["Qwen2ForSequenceClassification"]
    config.num_labels = 1
    config.pad_token_id = tok.VOCAB[tok.PAD]
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # (its load report: score.weight is new, as meant)
    try:
        with _no_progress_bars():
            model: Qwen2ForSequenceClassification = (
                Qwen2ForSequenceClassification.from_pretrained(str(policy), config=config,
                                                               local_files_only=True))
    finally:
        hf_logging.set_verbosity(verbosity)
    model.train(False)
    return model


def wrong_answer(problem: data.Problem, rng: random.Random) -> str:
    """A wrong sum: a near miss or a farther one, never negative."""
    right = problem.a + problem.b
    while True:
        size = rng.choice([*NEAR_MISSES, rng.randint(1, FAR_MISS)])
        guess = right + size * rng.choice((-1, 1))
        if guess >= 0:
            return str(guess)


@torch.no_grad()
def last_hidden(model: Qwen2ForSequenceClassification, rows: list[list[int]]) -> torch.Tensor:
    """The body's final hidden state at each row's last token [N, hidden]: what the served
    head scores. Rows of one length go through together, unpadded."""
    out = torch.empty(len(rows), model.config.hidden_size)
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_length.setdefault(len(row), []).append(i)
    for idx in by_length.values():
        ids = torch.tensor([rows[i] for i in idx])
        out[idx] = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, -1]
    return out


def _gaps(model: Qwen2ForSequenceClassification,
          pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Per pair: correct's features less wrong's (a linear head's score gap is w . gap)."""
    hidden = last_hidden(model, [row for pair in pairs for row in pair])
    return hidden[0::2] - hidden[1::2]


def fit_head(gaps: torch.Tensor, l2: float) -> torch.Tensor:
    """The head's weights minimising the pairwise logistic loss (+ l2 |w|^2)."""
    weight = torch.zeros(gaps.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([weight], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.softplus(-(gaps @ weight)).mean() + l2 * weight.square().sum()
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]
    return weight.detach()


def pairwise_accuracy(gaps: torch.Tensor, weight: torch.Tensor) -> float:
    """The share of pairs whose correct answer scores above the wrong one."""
    return round(float(((gaps @ weight) > 0).float().mean()), 4)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
