"""Per-model default CacheGen level: the most compressed level that keeps the model's predictions.

How much quantization a model's KV tolerates is a property of the model, not of the codec: the
same level costs one model a fraction of a percent of NLL and another several percent (the spread
of its keys, how many layers read them, which layers are global: ``bench/codec.py``). So, as the
blend budget, the level is measured per model by ``kvfuse calibrate MODEL --part codec`` and
stored in its profile (``BlendProfile.codec``); a CacheGen codec configured at level 0 then writes
that level for the model (``CacheGenCodec.for_model``), a configured level always wins.

The measurement (``measure_levels``): fictional QA items as plain prompts (12 documents, then the
question: several whole 256-token chunks), prefilled with a lossless (raw) memory tier; their
entries are re-encoded at each level (with the model's per-layer bins, as the engine writes them)
into a store of their own, and a second engine teacher-forces the prompt's last ``HELD_OUT``
tokens over the lossy KV. The NLL of those tokens against the lossless engine's (the same loads,
the same split of the computation: only the quantization differs), the KL between the two, and
the bytes against int8 (the simple lossy codec CacheGen must beat) make a row per level.

Each level is measured twice: K's channels as they are, and with K's outlier channels divided
down (``CAPS``: ``K_CAP`` times the median channel's abs-max; ``kvfuse/entropy/layer.py``). The
cap is per model because it helps some models' keys a lot (Qwen2.5-0.5B: KL at level 2 from 0.07
to 0.03) and hurts others' (Qwen2.5-1.5B: level 2 from within 2% to +12%; docs/benchmarks.md,
CacheGen, K's outlier channels); the profile records it (``codec.k_cap``) and the codec applies it
for the model (``CacheGenCodec.for_model``).

The choice (``choose_level``): the most compressed (level, cap) whose NLL is within
``MAX_NLL_INCREASE`` (relative) of lossless; when none is, the highest level (the row closest to
lossless of its two). Its size against int8 is reported with the target ``TARGET_VS_INT8`` (at
least 3x smaller), not enforced: a model that needs more bits gets them.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvfuse.codecs import get_codec
from kvfuse.codecs.cachegen import K_CAP, LEVELS
from kvfuse.config import BlendOptions, EngineSettings
from kvfuse.engine import Engine
from kvfuse.generation import SamplingParams
from kvfuse.kv.format import encode_entry
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier

from . import fictional_qa
from .measure import kl, nll

MAX_NLL_INCREASE = 0.02  # relative to lossless: what a level may cost at most
TARGET_VS_INT8 = 3.0  # how much smaller than int8 CacheGen aims to be (reported)
DOCUMENTS = 12  # documents per item: ~800-900 tokens, three whole 256-token chunks
HELD_OUT = 64  # the prompt's last tokens, teacher-forced over the (lossy) KV of the rest
_STORE_BYTES = 1 << 34  # memory tiers that never evict during a measurement
CAPS = (None, K_CAP)  # each level measured with K's channels as they are, then capped


class LevelRow(NamedTuple):
    """One measured level (and K cap: None, none): its NLL increase over lossless (relative) and
    how much smaller than int8."""

    level: int
    nll_increase: float
    ratio_vs_int8: float
    k_cap: float | None = None


@dataclass(frozen=True)
class LevelChoice:
    """The chosen level and K cap, why, and the row it was chosen by (None: no row met the
    target)."""

    level: int
    reason: str
    row: LevelRow | None
    k_cap: float | None = None


def _as_row(row: Sequence | Mapping) -> LevelRow:
    if isinstance(row, Mapping):
        cap = row.get("k_cap")
        return LevelRow(
            int(row["level"]),
            float(row["nll_increase"]),
            float(row["ratio_vs_int8"]),
            None if cap is None else float(cap),
        )
    return LevelRow(*row)


def _named(row: LevelRow) -> str:
    capped = "" if row.k_cap is None else f" with K's outlier channels capped at {row.k_cap:g}x"
    return f"level {row.level}{capped}"


def choose_level(
    rows: Sequence[Sequence | Mapping], max_nll_increase: float = MAX_NLL_INCREASE
) -> LevelChoice:
    """The most compressed row (the largest ``ratio_vs_int8``; on a tie the lower level, then no
    cap) whose NLL increase is at most ``max_nll_increase``; when none is, the highest level there
    is (closest to lossless; of its rows the one with the lower NLL). ``rows``: ``(level,
    nll_increase, ratio_vs_int8[, k_cap])`` tuples or ``measure_levels``' dicts."""
    measured = [_as_row(r) for r in rows]
    kept = [r for r in measured if r.nll_increase <= max_nll_increase]
    if kept:
        row = min(kept, key=lambda r: (-r.ratio_vs_int8, r.level, r.k_cap is not None))
        target = (
            ""
            if row.ratio_vs_int8 >= TARGET_VS_INT8
            else f", short of the {TARGET_VS_INT8:g}x target"
        )
        return LevelChoice(
            row.level,
            f"{_named(row)} is the most compressed whose NLL is within "
            f"{max_nll_increase:.0%} of lossless ({row.nll_increase:+.2%}); "
            f"{row.ratio_vs_int8:.2f}x smaller than int8{target}",
            row,
            row.k_cap,
        )
    top = max(LEVELS)
    closest = min(measured, key=lambda r: r.nll_increase, default=None)
    best = f" (the closest: {_named(closest)} at {closest.nll_increase:+.2%})" if closest else ""
    row = min((r for r in measured if r.level == top), key=lambda r: r.nll_increase, default=None)
    return LevelChoice(
        top,
        f"no measured level keeps the NLL within {max_nll_increase:.0%} of lossless{best}: "
        f"the highest, {top}",
        row,
        None if row is None else row.k_cap,
    )


def item_ids(tokenizer, item: fictional_qa.Item) -> list[int]:
    """``item`` as a plain prompt: its documents, then the question (no chat template: the KV of
    plain text is what every model has, and what the level is measured on)."""
    text = "\n\n".join(item.documents) + f"\n\nQuestion: {item.question}\nAnswer:"
    return tokenizer.encode(text)


def _settings(chunk_size: int) -> EngineSettings:
    # Plain prompts, so the blend is unused; a fixed one keeps ``auto`` from warning, for every
    # engine, about a model without a blend profile. Raw in memory: the reference is lossless.
    return EngineSettings.of(
        BlendOptions(recompute_ratio=0.15),
        chunk_size=chunk_size,
        history=False,
        async_save=False,
        prefetch=False,
    )


def _logits(engine: Engine, context: list[int], held_out: list[int], cached: int) -> torch.Tensor:
    """The logits predicting ``held_out`` after ``context``, once the engine has shown that it
    serves ``cached`` tokens of ``context`` from its store (a measurement of lossy KV that the
    engine silently recomputed would measure nothing). Closes the engine (and its store)."""
    try:
        res = engine.generate(context, SamplingParams(max_tokens=1, temperature=0))
        if res.cached_tokens < cached:
            raise RuntimeError(
                f"{res.cached_tokens} of the {cached} stored tokens were reused: the measured KV "
                "is not the stored one"
            )
        return engine.score(context, [held_out])[0][:-1].float()
    finally:
        engine.close()


def _encoded(entries: list, codec) -> list:
    """``entries`` (key, raw entry) re-encoded by ``codec``."""
    return [(key, encode_entry(entry.chunk(), key, codec)) for key, entry in entries]


def _store(entries: list) -> TieredStore:
    tier = MemoryTier(_STORE_BYTES)
    for key, entry in entries:
        tier.put(key, entry)
    return TieredStore(tier)


def _measure_item(
    model, ids: list[int], levels: Sequence[int], chunk_size: int, caps: Sequence = CAPS
) -> dict:
    """One prompt: the lossless NLL, each (level, K cap)'s NLL and KL, the bytes of its entries
    at each and in int8, and their tokens."""
    if len(ids) < chunk_size + HELD_OUT:
        raise ValueError(
            f"a prompt of {len(ids)} tokens has no whole {chunk_size}-token chunk before its "
            f"last {HELD_OUT}: use a smaller chunk size"
        )
    context, held_out = ids[:-HELD_OUT], ids[-HELD_OUT:]
    cached = len(context) // chunk_size * chunk_size
    raw = TieredStore(MemoryTier(_STORE_BYTES))
    engine = Engine(model, raw, _settings(chunk_size))
    try:
        engine.generate(
            context, SamplingParams(max_tokens=1, temperature=0)
        )  # stores the whole chunks
        entries = [(key, raw.memory.get(key)) for key in raw.memory.keys_lru()]
    except BaseException:
        engine.close()
        raise
    # The reference loads the raw entries it stored, as the lossy engines load theirs: the two
    # differ by the quantization only, not by how the prompt's computation was split.
    ref = _logits(engine, context, held_out, cached)
    int8 = _encoded(entries, get_codec("int8"))
    out = {
        "nll": nll(ref, held_out),
        "tokens": sum(e.num_tokens for _, e in entries),
        "int8_bytes": sum(len(e) for _, e in int8),
        "levels": {},
    }
    for level in levels:
        for cap in caps:
            codec = get_codec("cachegen", level).for_model(model.config.layer_types, k_cap=cap)
            out["levels"][level, cap] = _measure_encoding(
                model, entries, codec, (context, held_out, cached, ref), chunk_size
            )
    return out


def _measure_encoding(model, entries: list, codec, prompt: tuple, chunk_size: int) -> dict:
    """One encoding of a prompt's entries: the NLL and KL of its held-out tokens, its bytes."""
    context, held_out, cached, ref = prompt
    lossy = _encoded(entries, codec)
    logits = _logits(Engine(model, _store(lossy), _settings(chunk_size)), context, held_out, cached)
    return {
        "nll": nll(logits, held_out),
        "kl": kl(ref, logits),
        "bytes": sum(len(e) for _, e in lossy),
    }


def measure_levels(
    model,
    items: Sequence[fictional_qa.Item],
    levels: Sequence[int] = tuple(LEVELS),
    chunk_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
    caps: Sequence = CAPS,
) -> list[dict]:
    """Each CacheGen level of ``model`` (a ``LoadedModel``), with each K cap of ``caps``, against
    lossless KV on ``items``: one row per (level, cap), ``{level, k_cap, nll, nll_increase, kl,
    ratio_vs_int8, bytes_per_token}`` (NLL of the prompts' held-out tokens, its increase relative
    to lossless, mean KL, int8 bytes / the level's bytes); see the module docstring.
    ``progress(done, total)`` after each item."""
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise ValueError(f"cachegen levels are {', '.join(map(str, LEVELS))}; got {list(levels)}")
    per = []
    for i, item in enumerate(items):
        per.append(_measure_item(model, item_ids(model.tokenizer, item), levels, chunk_size, caps))
        if progress is not None:
            progress(i + 1, len(items))
    if not per:
        raise ValueError("no items to measure the levels on")
    base = statistics.mean(p["nll"] for p in per)
    int8, tokens = sum(p["int8_bytes"] for p in per), sum(p["tokens"] for p in per)
    rows = []
    for level, cap in ((lv, c) for lv in levels for c in caps):
        nlls = statistics.mean(p["levels"][level, cap]["nll"] for p in per)
        size = sum(p["levels"][level, cap]["bytes"] for p in per)
        rows.append(
            {
                "level": level,
                "k_cap": cap,
                "nll": round(nlls, 5),
                "nll_increase": round(nlls / base - 1, 5),
                "kl": round(statistics.mean(p["levels"][level, cap]["kl"] for p in per), 5),
                "ratio_vs_int8": round(int8 / size, 3),
                "bytes_per_token": round(size / tokens, 1),
            }
        )
    return rows


def calibrate_level(
    model,
    command: str,
    items: int = 6,
    split: str = "dev",
    chunk_size: int = 256,
    max_nll_increase: float = MAX_NLL_INCREASE,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Measure ``model``'s levels on ``items`` items of ``split`` and choose one: the profile's
    ``codec`` field (``cachegen_level``, ``reason``, the ``command`` that remeasures it, ``meta``,
    the ``measured`` rows)."""
    from kvfuse import __version__

    rows = measure_levels(
        model, fictional_qa.items(split, items, DOCUMENTS), chunk_size=chunk_size, progress=progress
    )
    choice = choose_level(rows, max_nll_increase)
    meta = {
        "split": split,
        "items": items,
        "documents": DOCUMENTS,
        "held_out": HELD_OUT,
        "chunk_size": chunk_size,
        "max_nll_increase": max_nll_increase,
        "kvfuse": __version__,
        "date": datetime.date.today().isoformat(),
    }
    return {
        "cachegen_level": choice.level,
        "k_cap": choice.k_cap,
        "reason": choice.reason,
        "command": command,
        "meta": meta,
        "measured": rows,
    }
