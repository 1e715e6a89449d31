"""Interleaved rounds and their summary.

A benchmark that compares candidates (engines, modes, configurations) runs every candidate once
per round, round after round, rather than each candidate's repetitions back to back: a slow
stretch of the shared machine then hits every candidate alike. The summary of a candidate's
samples is the median with the min and max beside it (the spread the tables show)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def spread(xs: Iterable[float], suffix: str = "", prefix: str = "") -> dict[str, float]:
    """``{prefix + "median" + suffix, ... "min" ..., ... "max" ...}`` of ``xs``; e.g.
    ``spread(s, "_tok_s")`` -> ``median_tok_s``, ``min_tok_s``, ``max_tok_s``."""
    xs = list(xs)
    return {
        f"{prefix}median{suffix}": statistics.median(xs),
        f"{prefix}min{suffix}": min(xs),
        f"{prefix}max{suffix}": max(xs),
    }


def order(names: list, round_index: int, alternate: bool = False, rotate: bool = False) -> list:
    """The candidates' order in a round: as given, reversed every other round (``alternate``), or
    rotated by one more place each round (``rotate``: round r starts with candidate r)."""
    if rotate and names:
        k = round_index % len(names)
        return list(names[k:]) + list(names[:k])
    return names[::-1] if alternate and round_index % 2 else list(names)


def interleaved(
    candidates: Mapping[Any, Callable[[int], T]],
    rounds: int,
    *,
    alternate: bool = False,
    rotate: bool = False,
    before_round: Callable[[int], None] | None = None,
    after_each: Callable[[Any, T], None] | None = None,
    after_round: Callable[[int, dict], None] | None = None,
) -> dict:
    """Run every candidate once per round for ``rounds`` rounds (called with the round index);
    each candidate's samples, in round order.

    ``alternate`` reverses the order every other round, ``rotate`` rotates it (so that no
    candidate always runs first);
    the hooks see the round index before it, each sample as it comes, and the samples so far
    after each round (progress lines, machine-load marks, a checkpoint)."""
    samples: dict = {name: [] for name in candidates}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for name in order(list(candidates), r, alternate, rotate):
            sample = candidates[name](r)
            samples[name].append(sample)
            if after_each is not None:
                after_each(name, sample)
        if after_round is not None:
            after_round(r, samples)
    return samples


def summarize(
    samples: Mapping[str, list[float]], suffix: str = "", prefix: str = ""
) -> dict[str, dict[str, float]]:
    """``spread`` of every candidate's samples."""
    return {name: spread(xs, suffix, prefix) for name, xs in samples.items()}


RATES = ("req_s", "out_tok_s")


def feature_cost(
    passes: Iterable[Mapping[str, Any]],
    flag: str,
    names: tuple[str, str] = ("off", "on"),
    rates: tuple[str, ...] = RATES,
) -> dict[str, dict]:
    """The throughput cost of a feature from interleaved passes with it off and on (each pass a
    dict with the bool ``flag`` and a value per rate). Returns, with ``names = (off, on)``: the
    medians per rate of each mode (``off``, ``on``), their ``(min, max)`` (``off_min_max``,
    ``on_min_max``) and ``cost``, ``1 - on / off`` of the medians rounded to 4 places (0.1: the
    feature costs 10% of the rate; negative: it came out faster)."""
    passes = list(passes)
    samples = {
        name: {k: [p[k] for p in passes if p[flag] is mode] for k in rates}
        for mode, name in zip((False, True), names)
    }
    med = {name: {k: statistics.median(xs) for k, xs in s.items()} for name, s in samples.items()}
    off, on = names
    return {
        **med,
        **{
            f"{n}_min_max": {k: (min(xs), max(xs)) for k, xs in s.items()}
            for n, s in samples.items()
        },
        "cost": {k: round(1 - med[on][k] / med[off][k], 4) for k in rates},
    }
