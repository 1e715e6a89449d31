"""The shapes a calibration question is asked in: a blend budget chosen on one prompt form can
fail on another (how many documents, where the answer sits, labels, chat or completion), so
every example is asked in one of several forms.

A ``Form``:

- ``chat``: a chat turn (the documents, then the question, in the last user message) or a
  completion ("Question: ...\\nAnswer:" after the documents). Chat only for a model that asks in
  chat (``measure.asks_in_chat``); base models such as gemma3-270m are asked as completions.
- ``labels``: each passage shown as "Passage 3: ..." (its 1-based place), or bare.
- ``documents``: how many passages (4-10 by default). The example's ``needed`` passages are always
  kept, the others in their own order until the count is reached; a source with fewer passages
  shows all it has.
- ``position``: where the passage stating the answer goes: ``first``, ``middle``
  (index ``count // 2``) or ``last``; the other passages keep their order. Without a gold answer
  found in a passage (CacheBlend examples; MuSiQue questions whose answer no passage states
  verbatim) the order is the source's and ``CalibrationItem.answer_at`` is None.

``assign`` gives each example one form, deterministically: the ``j``-th example of each source
gets kind/labels/position combination ``j mod 12`` and document count ``j mod 7`` (coprime
cycles: every combination with every count over 84 examples). One form per example, not every
form, so items stay independent (the interval in ``interval`` assumes so).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .answers import any_correct
from .sources import Example

KINDS = ("chat", "completion")
LABELS = ("labeled", "unlabeled")
POSITIONS = ("first", "middle", "last")
DOCUMENTS = tuple(range(4, 11))


@dataclass(frozen=True)
class Form:
    chat: bool
    labels: bool
    documents: int
    position: str

    def describe(self) -> str:
        kind = "chat" if self.chat else "completion"
        return (
            f"{kind}/{'labeled' if self.labels else 'unlabeled'}/{self.documents}/{self.position}"
        )


@dataclass(frozen=True)
class CalibrationItem:
    """One example in one form: what ``measure`` asks. ``answers`` empty: full prefill's answer is
    the reference. ``answer_at``: the index of the passage stating the answer, None if unknown."""

    source: str
    index: int
    form: Form
    documents: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    answer_at: int | None

    @property
    def key(self) -> str:
        return f"{self.source}:{self.index}"

    @property
    def answer(self) -> str:
        return self.answers[0] if self.answers else ""


@dataclass(frozen=True)
class FormSpace:
    """The forms examples are spread over (``assign``)."""

    kinds: tuple[str, ...] = KINDS
    labels: tuple[str, ...] = LABELS
    positions: tuple[str, ...] = POSITIONS
    documents: tuple[int, ...] = DOCUMENTS

    def combinations(self) -> list[tuple[str, str, str]]:
        return list(itertools.product(self.kinds, self.labels, self.positions))

    def describe(self) -> dict:
        return {
            "kinds": list(self.kinds),
            "labels": list(self.labels),
            "positions": list(self.positions),
            "documents": list(self.documents),
        }


def parse_forms(text: str | None, documents: Sequence[int] = DOCUMENTS) -> FormSpace:
    """``--forms``: a comma list of chat, completion, labeled, unlabeled, first, middle, last; an
    axis none of whose values is named keeps all of them. ValueError naming an unknown word."""
    words = [w.strip() for w in (text or "").split(",") if w.strip()]
    known = KINDS + LABELS + POSITIONS
    bad = [w for w in words if w not in known]
    if bad:
        raise ValueError(f"unknown form {bad[0]!r}; use a list of: {', '.join(known)}")
    if not documents or any(not 1 <= d <= 64 for d in documents):
        raise ValueError(f"document counts must be 1..64, got {list(documents)}")

    def axis(values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(v for v in values if v in words) or values

    return FormSpace(axis(KINDS), axis(LABELS), axis(POSITIONS), tuple(documents))


def for_model(space: FormSpace, chat_capable: bool) -> FormSpace:
    """``space`` without chat for a model that is not asked in chat; ValueError when only chat was
    asked for."""
    if chat_capable:
        return space
    if "completion" not in space.kinds:
        raise ValueError(
            "this model has no chat template (or is a base model): use completion forms"
        )
    return FormSpace(("completion",), space.labels, space.positions, space.documents)


def _chosen(example: Example, count: int) -> list[int]:
    """The passages shown: the needed ones, then others in order, up to ``count``."""
    needed = set(example.needed)
    keep = set(needed)
    for k in range(len(example.documents)):
        if len(keep) >= count:
            break
        keep.add(k)
    return sorted(keep)


def _place(order: list[int], at: int | None, position: str) -> list[int]:
    if at is None:
        return order
    rest = [k for k in order if k != at]
    slot = {"first": 0, "middle": len(order) // 2, "last": len(order) - 1}[position]
    return rest[:slot] + [at] + rest[slot:]


def apply(example: Example, form: Form) -> CalibrationItem:
    """``example`` asked in ``form`` (see the module docstring)."""
    order = _chosen(example, form.documents)
    # the stating passage is looked for among the needed ones first: a distractor may share the
    # answer's words (two fictional people born the same year)
    candidates = [k for k in order if k in example.needed] or order
    stating = [
        k
        for k in candidates
        if example.answers and any_correct(example.documents[k], example.answers)
    ]
    at = stating[0] if stating else None
    order = _place(order, at, form.position)
    docs = [example.documents[k] for k in order]
    if form.labels:
        docs = [f"Passage {i + 1}: {d}" for i, d in enumerate(docs)]
    where = order.index(at) if at is not None else None
    return CalibrationItem(
        example.source, example.index, form, tuple(docs), example.question, example.answers, where
    )


def assign(examples: Sequence[Example], space: FormSpace) -> list[CalibrationItem]:
    """Each example in one form of ``space`` (see the module docstring)."""
    combos = space.combinations()
    seen: dict[str, int] = {}
    out = []
    for ex in examples:
        j = seen.get(ex.source, 0)
        seen[ex.source] = j + 1
        kind, labels, position = combos[j % len(combos)]
        count = space.documents[j % len(space.documents)]
        out.append(apply(ex, Form(kind == "chat", labels == "labeled", count, position)))
    return out
