"""When an answer counts as correct: the gold answer's words, normalised, appear in it in order.

One rule for every source and every part of calibration (``measure`` scores with it, ``forms``
finds the document that states the answer with it), so it lives apart from the torch code.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence


def normalize(text: str) -> str:
    """Lower case, without punctuation and articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def correct(answer: str, gold: str) -> bool:
    """The gold answer's words appear, in order, in the answer (normalised)."""
    return re.search(rf"\b{re.escape(normalize(gold))}\b", normalize(answer)) is not None


def any_correct(answer: str, golds: Sequence[str]) -> bool:
    """``correct`` for one of several gold answers (aliases); an empty gold never matches (a gold
    that normalises to nothing would be found in every answer)."""
    return any(normalize(g) and correct(answer, g) for g in golds)
