"""Token selection and stopping: sampling parameters, the sampler, stop-string matching.

Pure logic, no model: the engine's decode loop calls ``Sampler`` on each logits vector and feeds
decoded text through ``StopMatcher``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

# The longest stop string accepted: StopMatcher's work per token grows with its square.
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy decoding."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # A compiled grammar that constrains the output (``Structure``: its ``matcher()`` gives each
    # sequence its own ``TokenConstraint``); None: free decoding.
    structure: Structure | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(
            isinstance(self.max_tokens, int)
            and not isinstance(self.max_tokens, bool)
            and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _real(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be a number in [0, 100] (0 = greedy), got {self.temperature!r}",
        )
        _check(
            _real(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            f"must be an integer >= 0, got {self.top_k!r}",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            f"must be a non-negative integer, got {self.seed!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        _check(  # matching holds back up to a stop's length and compares O(length^2) per token
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            "stop",
            f"must each be at most {MAX_STOP_CHARS} characters",
        )

    @property
    def greedy(self) -> bool:
        # Below 1e-5, logits / temperature overflows float32; the limit is greedy decoding anyway.
        return self.temperature < _MIN_TEMPERATURE


_MIN_TEMPERATURE = 1e-5


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


class TokenConstraint(Protocol):
    """One sequence's constrained decoding: which tokens may come next, given those so far."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token that may not come next at ``-inf``."""

    def accept(self, token: int) -> None:
        """``token`` was generated (one ``mask`` allowed)."""

    @property
    def done(self) -> bool:
        """The output is complete: the sequence ends (finish reason ``stop``)."""


class Structure(Protocol):
    """A compiled constraint (a JSON schema, a tool call's shape), shared by the requests that
    use it; each sequence decodes with a ``matcher()`` of its own."""

    def matcher(self) -> TokenConstraint: ...


@dataclass
class Sampler:
    """Picks the next token from a logits vector: argmax, or seeded temperature / top-k / top-p."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            probs = top_p_filter(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise."""
    sorted_probs, order = torch.sort(probs, descending=True)
    # mass of strictly more likely tokens
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = before >= top_p
    # the most likely token always stays (a top_p that rounds to 0 keeps just it)
    drop[..., 0] = False
    sorted_probs[drop] = 0.0
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum()


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could start one.

    ``feed(piece)`` returns the text that is safe to emit; once a stop string appears, the text
    before it is emitted and ``stopped`` becomes True. ``flush()`` releases the held-back tail
    when generation ends for another reason.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(i for i, _ in hits)]
        keep = max((_partial_suffix(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
