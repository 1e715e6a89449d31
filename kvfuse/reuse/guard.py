"""The online guard of blending (``blend.verify_rate``): calibrated once, checked continuously.

A blend (documents or found spans, reused at new positions with part of their tokens recomputed)
is approximate: the budget a calibration chose keeps the answers on the data it was measured on.
The guard checks it on live traffic. A sample of the requests that blended (``verify_rate``) is
queued; when the engine has nothing else to do, each is scored twice, teacher-forced along the
answer it gave: once blended as it was served, once as a full prefill of the same token ids
(``Engine.score``). The request *agrees* when the two predict the same first ``verify_tokens``
tokens; the KL divergence of the first token's distribution is recorded beside it. Over the last
``verify_window`` verified requests, once at least ``verify_min`` are in, an agreement below
``verify_target`` makes the model's blends fall back to exact prefix reuse (the documents are
prompt text, the answer a full prefill's), with a log line saying why; requests with documents
are still sampled meanwhile and verified with the blend they would have used, so blending comes
back once the agreement recovers. A request's own ``recompute_ratio`` is the client's choice and
is never overridden. No serving system has this; it turns "calibrated once" into "checked
continuously". ``compare`` and ``Window`` are pure and table-tested.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvfuse.blend.options import BlendOptions
from kvfuse.counters import Counters
from kvfuse.prompts.prompt import Prompt

from .options import CacheOptions
from .state import Reuse

log = logging.getLogger(__name__)

QUEUE_LIMIT = 64  # verifications waiting for idle time; beyond it a sample is dropped (counted)


@dataclass(frozen=True)
class Verification:
    """One sampled request: its prompt as it ran, the blend to check, its answer's tokens."""

    prompt: Prompt
    blend: BlendOptions
    cache: CacheOptions
    tokens: tuple[int, ...]


@dataclass
class GuardStats(Counters):
    blend_verify_sampled: int = 0
    blend_verify_dropped: int = 0
    blend_verified: int = 0
    blend_verify_agreed: int = 0
    blend_fallbacks: int = 0  # times the guard switched blending off


def compare(full: torch.Tensor, blended: torch.Tensor, tokens: int) -> tuple[bool, float]:
    """Whether teacher-forced logits ``full`` and ``blended`` (rows: positions) predict the same
    first ``tokens`` tokens, and the KL divergence KL(full || blended) of the first row."""
    n = min(tokens, full.shape[0], blended.shape[0])
    agree = bool(torch.equal(full[:n].argmax(-1), blended[:n].argmax(-1)))
    p = torch.log_softmax(full[0].float(), -1)
    q = torch.log_softmax(blended[0].float(), -1)
    return agree, float((p.exp() * (p - q)).sum())


class Window:
    """The last ``size`` outcomes; the fallback decision over them."""

    def __init__(self, size: int, minimum: int, target: float):
        self.outcomes: collections.deque[bool] = collections.deque(maxlen=size)
        self.minimum, self.target = minimum, target

    def add(self, agreed: bool) -> None:
        self.outcomes.append(agreed)

    @property
    def agreement(self) -> float | None:
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else None

    def below(self) -> bool:
        """Enough outcomes, and their agreement under the target."""
        a = self.agreement
        return len(self.outcomes) >= self.minimum and a is not None and a < self.target


class BlendGuard:
    """One engine's guard; see the module docstring. ``sample`` and ``apply`` run on the
    engine's threads, ``verify_one`` on the engine's loop when it is idle."""

    def __init__(self, options: BlendOptions, model: str, seed: int = 0):
        self.rate, self.tokens = options.verify_rate, options.verify_tokens
        self.model = model
        self.window = Window(options.verify_window, options.verify_min, options.verify_target)
        self.stats = GuardStats()
        self.fallback = False
        self.last_kl: float | None = None
        self._queue: collections.deque[Verification] = collections.deque()
        self._lock = threading.Lock()
        self._random = random.Random(seed)

    @property
    def on(self) -> bool:
        return self.rate > 0

    def apply(self, blend: BlendOptions) -> BlendOptions:
        """``blend`` as the guard lets it run now: exact prefix reuse while it falls back (a
        request's own budget excepted)."""
        if not (self.fallback and blend.blends and blend.source != "request"):
            return blend
        return replace(blend, method="prefix", source="guard")

    def sample(self, r: Reuse, generated: list[int]) -> None:
        """Queue ``r`` for verification, at ``verify_rate``, if it blended (or, while the guard
        falls back, would have)."""
        blend = r.used_blend if r.used_blend is not None else r.shadow
        if not self.on or blend is None or not blend.blends or not generated:
            return
        if self._random.random() >= self.rate:
            return
        job = Verification(r.prompt, blend, r.cache, tuple(generated[: self.tokens]))
        with self._lock:
            if len(self._queue) >= QUEUE_LIMIT:
                self.stats.add(blend_verify_dropped=1)
                return
            self._queue.append(job)
        self.stats.add(blend_verify_sampled=1)

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def verify_one(self, score: Callable[..., list[torch.Tensor]]) -> bool:
        """Verify the oldest queued request with ``score`` (``Engine.score``); False if none."""
        with self._lock:
            job = self._queue.popleft() if self._queue else None
        if job is None:
            return False
        conts = [list(job.tokens)]
        (blended,) = score(job.prompt, conts, cache=job.cache, blend=job.blend)
        (full,) = score(job.prompt.ids, conts, cache=CacheOptions(enabled=False))
        agreed, kl = compare(full, blended, self.tokens)
        self.record(agreed, kl)
        return True

    def record(self, agreed: bool, kl: float) -> None:
        """One verified request: into the window, and the fallback decided again."""
        self.stats.add(blend_verified=1, blend_verify_agreed=int(agreed))
        self.window.add(agreed)
        self.last_kl = kl
        below = self.window.below()
        if below and not self.fallback:
            self.fallback = True
            self.stats.add(blend_fallbacks=1)
            log.warning(
                "blend guard: %s agreed with a full prefill on %.0f%% of the last %d verified "
                "requests (target %.0f%%): blending falls back to exact prefix reuse",
                self.model,
                100 * self.window.agreement,
                len(self.window.outcomes),
                100 * self.window.target,
            )
        elif self.fallback and not below and len(self.window.outcomes) >= self.window.minimum:
            self.fallback = False
            log.warning(
                "blend guard: %s agrees again (%.0f%% of the last %d): blending resumes",
                self.model,
                100 * self.window.agreement,
                len(self.window.outcomes),
            )

    def counters(self) -> dict:
        if not self.on:
            return {}
        a = self.window.agreement
        return {
            **self.stats.snapshot(),
            "blend_verify_agreement": a if a is not None else -1.0,
            "blend_verify_last_kl": self.last_kl if self.last_kl is not None else -1.0,
            "blend_fallback": int(self.fallback),
            "blend_verify_pending": self.pending(),
        }
