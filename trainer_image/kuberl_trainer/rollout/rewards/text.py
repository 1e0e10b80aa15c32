"""String-matching rewards: exact match and SQuAD-style token F1."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def exact_match(response: str, label: str) -> float:
    """1.0 when response and label are equal after collapsing whitespace and case-folding.

    Deliberately exact: no answer extraction ("the last number in the response") and no
    punctuation stripping. A response that wraps the answer in prose scores 0; use ``math``
    or ``f1`` (or a custom function) when answers come embedded in text.
    """
    return float(squash(response) == squash(label))


def token_f1(response: str, label: str) -> float:
    """SQuAD token F1 between the normalised response and label, in ``[0, 1]``.

    Normalisation (SQuAD's): lower-case, drop punctuation, drop the articles a/an/the,
    split on whitespace. Overlap counts tokens with multiplicity. When either side has no
    tokens the score is 1.0 if both are empty, else 0.0 (F1 is undefined there).
    """
    predicted, gold = normalised_tokens(response), normalised_tokens(label)
    if not predicted or not gold:
        return float(predicted == gold)
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def squash(text: str) -> str:
    return " ".join(text.split()).casefold()


def normalised_tokens(text: str) -> list[str]:
    text = text.lower().translate(_PUNCTUATION)
    return _ARTICLES.sub(" ", text).split()
