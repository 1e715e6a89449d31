"""``SamplingParams``' validation: each check raises ValueError starting with the field's name
(the server turns that into a 400 naming it). Split by group so that each stays readable."""

from __future__ import annotations

import math
from typing import Any

from .logprobs import MAX_TOP_LOGPROBS

# ``kvfuse.generation.SamplingParams``, by duck type: generation builds on this package, so this
# package does not import it (not even for type checking: the layout test forbids the cycle).
SamplingParams = Any

MAX_CHOICES = 128  # OpenAI's limit on ``n``
MAX_STOPS = 16
BIAS_LIMIT = 100.0


def real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


def check_params(p: SamplingParams) -> None:
    check_length_and_choices(p)
    check_distribution(p)
    check_penalties(p)
    check_stops(p)
    check_logprobs(p)


def check_length_and_choices(p: SamplingParams) -> None:
    check(
        integer(p.max_tokens) and p.max_tokens >= 1,
        "max_tokens",
        f"must be an integer >= 1, got {p.max_tokens!r}",
    )
    check(
        integer(p.n) and 1 <= p.n <= MAX_CHOICES,
        "n",
        f"must be an integer in [1, {MAX_CHOICES}], got {p.n!r}",
    )
    check(
        p.seed is None or (integer(p.seed) and 0 <= p.seed < 2**63),
        "seed",
        f"must be a non-negative integer, got {p.seed!r}",
    )


def check_distribution(p: SamplingParams) -> None:
    check(
        real(p.temperature) and 0.0 <= p.temperature <= 100.0,
        "temperature",
        f"must be a number in [0, 100] (0 = greedy), got {p.temperature!r}",
    )
    check(real(p.top_p) and 0.0 < p.top_p <= 1.0, "top_p", f"must be in (0, 1], got {p.top_p!r}")
    check(
        integer(p.top_k) and p.top_k >= 0,
        "top_k",
        f"must be an integer >= 0 (0 = off), got {p.top_k!r}",
    )
    check(real(p.min_p) and 0.0 <= p.min_p <= 1.0, "min_p", f"must be in [0, 1], got {p.min_p!r}")


def check_penalties(p: SamplingParams) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(p, name)
        check(real(v) and -2.0 <= v <= 2.0, name, f"must be a number in [-2, 2], got {v!r}")
    r = p.repetition_penalty
    check(
        real(r) and 0.0 < r <= 100.0,
        "repetition_penalty",
        f"must be a number in (0, 100] (1 = off), got {r!r}",
    )
    for token, bias in p.logit_bias:
        check(
            integer(token) and token >= 0,
            "logit_bias",
            f"keys must be token ids (integers >= 0), got {token!r}",
        )
        check(
            real(bias) and -BIAS_LIMIT <= bias <= BIAS_LIMIT,
            "logit_bias",
            f"values must be numbers in [-100, 100], got {bias!r} for token {token}",
        )


# The longest stop string accepted: StopMatcher's work per token grows with its square.
MAX_STOP_CHARS = 256


def check_stops(p: SamplingParams) -> None:
    check(all(isinstance(s, str) and s for s in p.stop), "stop", "must be non-empty strings")
    check(len(p.stop) <= MAX_STOPS, "stop", f"at most {MAX_STOPS} stop strings")
    check(  # matching holds back up to a stop's length and compares O(length^2) per token
        all(len(s) <= MAX_STOP_CHARS for s in p.stop),
        "stop",
        f"must each be at most {MAX_STOP_CHARS} characters",
    )
    check(
        all(integer(t) and t >= 0 for t in p.stop_token_ids),
        "stop_token_ids",
        "must be token ids (integers >= 0)",
    )


def check_logprobs(p: SamplingParams) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        check(
            v is None or (integer(v) and 0 <= v <= MAX_TOP_LOGPROBS),
            name,
            f"must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got {v!r}",
        )
