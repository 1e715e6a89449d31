"""Token selection and stopping: sampling parameters, the constraint protocols, stop strings.

Pure logic, no model: the engine's decode loop adjusts each logits vector (``kvfuse.sampling``:
bias, penalties), masks it by the sequence's ``TokenConstraint``, picks a token with its
``Sampler`` and feeds the decoded text through ``StopMatcher``. ``Sampler`` and ``top_p_filter``
live in ``kvfuse.sampling`` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfuse.sampling.checks import MAX_STOP_CHARS, check_params
from kvfuse.sampling.processors import top_p_filter
from kvfuse.sampling.sampler import Sampler

__all__ = [
    "MAX_STOP_CHARS",
    "Sampler",
    "SamplingParams",
    "StopMatcher",
    "Structure",
    "TokenConstraint",
    "top_p_filter",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy decoding.

    The fields follow OpenAI's API (``n``, ``frequency_penalty``, ``presence_penalty``,
    ``logit_bias``, ``seed``, ``logprobs``) and vLLM's extensions (``top_k``, ``min_p``,
    ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``prompt_logprobs``); the order
    they apply in is ``kvfuse.sampling``'s. Checked on construction (``sampling.checks``)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # of choice 0; choice i's is derived from it (``sampling.seeds``)
    n: int = 1  # choices sampled from one prompt (its KV computed once, then forked)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    # (token id, bias in [-100, 100]) pairs, added to the raw logits; a dict is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()
    # alternatives per generated token to report with its logprob (None: no logprobs)
    logprobs: int | None = None
    # the same for every prompt token (None: none; the first token has no logprob)
    prompt_logprobs: int | None = None
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
        bias = self.logit_bias
        pairs = tuple((k, v) for k, v in (bias.items() if isinstance(bias, Mapping) else bias))
        try:
            pairs = tuple(sorted(pairs))
        except TypeError:  # a key of the wrong type: check_params names it
            pass
        object.__setattr__(self, "logit_bias", pairs)
        check_params(self)

    @property
    def greedy(self) -> bool:
        # Below 1e-5, logits / temperature overflows float32; the limit is greedy decoding anyway.
        return self.temperature < _MIN_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """A logit bias or a penalty applies (``sampling.history``): without one, the raw logits
        are sampled as they are (greedy decoding is then exactly their argmax)."""
        return bool(
            self.logit_bias
            or self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
        )


_MIN_TEMPERATURE = 1e-5


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


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could start one.

    ``feed(piece)`` returns the text that is safe to emit; once a stop string appears, the text
    before it is emitted, ``stopped`` becomes True and ``matched`` is that stop string (the one
    that starts first; the earlier-listed one on a tie: APIs such as Anthropic's report which one
    ended the text). ``flush()`` releases the held-back tail when generation ends for another
    reason.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._held = ""
            return text[:at]
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
