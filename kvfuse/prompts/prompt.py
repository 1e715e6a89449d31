"""A prompt as the engine sees it: segments, not a flat list of token ids.

``[prefix][document]...[document][suffix]``: the prefix is reused as exact chunks of a hash chain
(prefix caching), each document is tokenized on its own and cached on its own (reusable at any
position), and the suffix (a question, the new turn) is always computed. A plain prompt is one
prefix segment; the planner still computes its last token, whose logits give the first token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class SegmentKind(enum.Enum):
    PREFIX = "prefix"
    DOCUMENT = "document"
    SUFFIX = "suffix"


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Prompt:
    """Segments in order: at most one prefix (first), documents, at most one suffix (last); none empty."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        kinds = [s.kind for s in self.segments]
        if not kinds:
            raise ValueError("the prompt is empty")
        if any(len(s) == 0 for s in self.segments):
            raise ValueError("a prompt segment is empty")
        if SegmentKind.PREFIX in kinds[1:] or kinds.count(SegmentKind.PREFIX) > 1:
            raise ValueError("a prompt has at most one prefix, and it comes first")
        if SegmentKind.SUFFIX in kinds[:-1] or kinds.count(SegmentKind.SUFFIX) > 1:
            raise ValueError("a prompt has at most one suffix, and it comes last")

    @classmethod
    def plain(cls, ids: Sequence[int]) -> Prompt:
        """An ordinary prompt: one prefix segment."""
        return cls((Segment(SegmentKind.PREFIX, tuple(int(t) for t in ids)),))

    @classmethod
    def of(
        cls,
        prefix: Sequence[int] = (),
        documents: Sequence[Sequence[int]] = (),
        suffix: Sequence[int] = (),
    ) -> Prompt:
        """``[prefix][documents...][suffix]``; empty parts are left out (an empty document is an error)."""
        segments = []
        if prefix:
            segments.append(Segment(SegmentKind.PREFIX, tuple(int(t) for t in prefix)))
        for i, doc in enumerate(documents):
            if len(doc) == 0:
                raise ValueError(f"document {i} is empty")
            segments.append(Segment(SegmentKind.DOCUMENT, tuple(int(t) for t in doc)))
        if suffix:
            segments.append(Segment(SegmentKind.SUFFIX, tuple(int(t) for t in suffix)))
        return cls(tuple(segments))

    @property
    def ids(self) -> list[int]:
        """Every token id, in order."""
        return [t for s in self.segments for t in s.ids]

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def prefix(self) -> tuple[int, ...]:
        first = self.segments[0]
        return first.ids if first.kind is SegmentKind.PREFIX else ()

    @property
    def documents(self) -> list[tuple[int, tuple[int, ...]]]:
        """(start offset in the prompt, ids) of every document, in order."""
        out, offset = [], 0
        for s in self.segments:
            if s.kind is SegmentKind.DOCUMENT:
                out.append((offset, s.ids))
            offset += len(s)
        return out

    @property
    def is_plain(self) -> bool:
        """No documents."""
        return all(s.kind is not SegmentKind.DOCUMENT for s in self.segments)

    @property
    def is_prefix_only(self) -> bool:
        """One prefix segment (a chat or a completion without documents): what whole-history
        reuse, tail entries and cache breakpoints apply to."""
        return len(self.segments) == 1 and self.segments[0].kind is SegmentKind.PREFIX
