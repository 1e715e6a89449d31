"""Measuring a model's blends against full prefill: what ``kvfuse calibrate`` runs.

On calibration items (``forms.CalibrationItem``: an example of ``sources`` in one prompt form; or
plain ``fictional_qa`` items, asked in the model's one form), each item's prompt is answered by a
full prefill (the reference) and by every blend setting given, with greedy decoding:

- correct: one of the gold answers appears in the answer (normalised text, ``answers``); an item
  without a gold answer (CacheBlend examples) counts full prefill correct when it answered
  anything, and a setting correct when its answer contains full prefill's. Per item, so that
  answers kept vs full prefill (``interval.Kept``) and its interval can be computed; accuracy is
  also summed as a fraction of full prefill's;
- KL: the mean KL(full prefill || blend) of the next-token distributions along full prefill's
  answer (teacher-forced), as a fraction of full reuse's (ratio 0);
- NLL: the mean negative log-likelihood of full prefill's answer (teacher-forced), in nats per
  token (full prefill's own is its confidence in its answer; a blend's is higher when it drifts);
- TTFT: the median time to the first token with the documents' KV in memory, as a fraction of a
  full prefill's.

A blend's documents are cached before its timed request (the score pass stores them), and the
blended prompt itself is never stored (``store_blended`` off), so every timed request blends.
A setting that does not blend (method ``prefix``) runs with the cache off: reusing documents in a
new order is then a full prefill, while the repeated identical prompt would be a prefix hit that
says nothing about reuse at another position.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from kvfuse.config import BlendOptions
from kvfuse.prompts import PromptBuilder

from . import fictional_qa
from .answers import any_correct, correct, normalize  # noqa: F401 (re-exported)
from .choose import Measurement
from .forms import CalibrationItem
from .interval import can_reach, kept

QUESTION = "Answer the question using the passages above, in a few words.\nQuestion: {question}"
BASE_MODELS = ("gemma3-270m",)  # built-in models without instruction tuning: asked as completions


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(ref || other) over rows of next-token logits."""
    p = F.log_softmax(ref_logits.float(), dim=-1)
    q = F.log_softmax(logits.float(), dim=-1)
    return float((p.exp() * (p - q)).sum(dim=-1).mean())


def nll(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """Mean negative log-likelihood of ``token_ids`` under rows of next-token logits."""
    targets = torch.tensor(
        list(token_ids), dtype=torch.long, device=logits.device
    )  # logits may be on a GPU
    return float(F.cross_entropy(logits.float(), targets))


def asks_in_chat(engine) -> bool:
    """Whether items go to the model as a chat turn: it has a chat template and is not a base model."""
    return engine.model.tokenizer.chat_template is not None and engine.model.name not in BASE_MODELS


def item_prompt(prompts: PromptBuilder, item: fictional_qa.Item | CalibrationItem, chat: bool):
    """The item as a prompt: a chat turn (documents before the question), or a completion. A
    ``CalibrationItem`` says which itself (its form); ``chat`` is for plain fictional items."""
    if isinstance(item, CalibrationItem):
        chat = item.form.chat
    if chat:
        text = QUESTION.format(question=item.question)
        return prompts.document_prompt(
            list(item.documents), messages=[{"role": "user", "content": text}]
        )
    return prompts.document_prompt(
        list(item.documents), prompt=f"Question: {item.question}\nAnswer:"
    )


@dataclass
class Tally:
    """One configuration's results over the items it ran on (the first ``len(hits)`` items)."""

    hits: list[bool] = field(default_factory=list)  # per item, in order: correct or not
    kl: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    eliminated_after: int | None = None  # items run when it could no longer reach the target

    @property
    def correct(self) -> int:
        return sum(self.hits)


@dataclass(frozen=True)
class Progress:
    """Where ``measure`` stands after an item: items done of the total, seconds since it began,
    blend settings still running (not eliminated) of those given."""

    done: int
    total: int
    elapsed_s: float
    alive: int
    settings: int


@dataclass
class Report:
    """Every configuration's tally, full prefill's first (under ``"full prefill"``). ``items``:
    the items measured; ``planned``: those given (more when ``measure`` stopped early, every blend
    setting eliminated)."""

    items: int
    tallies: dict[str, Tally]
    configs: dict[str, BlendOptions]
    planned: int | None = None

    @property
    def stopped_after(self) -> int | None:
        """The items measured when measuring stopped early (None: it ran every item)."""
        return self.items if self.planned is not None and self.items < self.planned else None

    def runs(self) -> tuple[int, int]:
        """(settings run on an item, of those a full grid runs): the work early elimination left
        (each is a score pass and a generate; full prefill's runs are not counted)."""
        settings = [t for name, t in self.tallies.items() if name != "full prefill"]
        done = sum(len(t.hits) for t in settings)
        return done, len(settings) * (self.planned if self.planned is not None else self.items)

    def measurements(self) -> list[Measurement]:
        """A row per blend setting, over the items it ran on: full prefill's answers, full
        reuse's KL and full prefill's TTFT are taken over the same items."""
        full, reuse = self.tallies["full prefill"], self.tallies.get("full reuse")
        out = []
        for name, opts in self.configs.items():
            if opts.full_reuse:
                continue
            t = self.tallies[name]
            ran = len(t.hits)
            reuse_kl = statistics.mean(reuse.kl[:ran]) if reuse and reuse.kl[:ran] else None
            out.append(
                Measurement(
                    opts.method,
                    float(opts.recompute_ratio),
                    kept(full.hits[:ran], t.hits),
                    statistics.mean(t.kl) / reuse_kl if reuse_kl else float("inf"),
                    statistics.median(t.ttft_s) / statistics.median(full.ttft_s[:ran]),
                    extra=_extra(opts),
                )
            )
        return out

    def rows(self, confidence: float = 0.95) -> list[dict]:
        """A table row per configuration over the items it ran on (answers kept with their bounds
        at ``confidence``, accuracy, KL, TTFT; ``eliminated_after`` for an eliminated one), for
        printing and the profile."""
        full = self.tallies["full prefill"]
        out = []
        for name, t in self.tallies.items():
            ran = len(t.hits)
            full_correct = sum(full.hits[:ran])
            row = {
                "config": name,
                **kept(full.hits[:ran], t.hits).as_dict(confidence),
                "correct": t.correct,
                "items": ran,
                "accuracy_vs_full": round(t.correct / full_correct, 4) if full_correct else None,
                "kl": round(statistics.mean(t.kl), 4) if t.kl else 0.0,
                "nll": round(statistics.mean(t.nll), 4),
                "ttft_ms": round(1000 * statistics.median(t.ttft_s), 1),
            }
            if t.eliminated_after is not None:
                row["eliminated_after"] = t.eliminated_after
            out.append(row)
        return out


def _extra(opts: BlendOptions) -> tuple[tuple[str, object], ...]:
    base = BlendOptions()
    return tuple(
        (k, getattr(opts, k))
        for k in ("check_layer", "deviation", "document_context")
        if getattr(opts, k) != getattr(base, k)
    )


def configurations(
    methods: Sequence[str],
    ratios: Sequence[float],
    base: BlendOptions = BlendOptions(),
    variants: Sequence[dict] = (),
) -> dict[str, BlendOptions]:
    """Full reuse, then every method at every ratio, then each variant (options over ``base``) at
    every ratio; named for tables."""
    base = replace(base, store_blended=False, source="config")
    out = {"full reuse": replace(base, recompute_ratio=0.0, method="hkvd")}
    for m in methods:
        for r in ratios:
            out[f"{m} {r:g}"] = replace(base, method=m, recompute_ratio=float(r))
    for v in variants:
        label = " ".join(f"{k}={x}" for k, x in v.items())
        for r in ratios:
            opts = replace(base, **v, recompute_ratio=float(r))
            out[f"{opts.method} {label} {r:g}"] = opts
    return out


def judge(text: str, item, reference: str) -> bool:
    """Whether ``text`` answers ``item``: one of its gold answers appears in it; without a gold
    answer, full prefill's answer ``reference`` does (and, for full prefill itself, that it
    answered anything)."""
    golds = getattr(item, "answers", None)
    golds = (item.answer,) if golds is None else golds
    return any_correct(text, golds) if golds else any_correct(text, (reference,))


def _record(tally: Tally, ok: bool, ttft_s: float) -> None:
    tally.hits.append(ok)
    tally.ttft_s.append(ttft_s)


def eliminate(
    tallies: dict[str, Tally], blends: Sequence[str], left: int, target: float, confidence: float
) -> list[str]:
    """The settings of ``blends`` (not yet eliminated) that can no longer reach a lower bound of
    answers kept >= ``target`` with ``left`` items to go (``interval.can_reach``); each is marked
    eliminated after the items it ran."""
    full = tallies["full prefill"].hits
    out = []
    for name in blends:
        t = tallies[name]
        got = kept(full[: len(t.hits)], t.hits)
        if t.eliminated_after is None and not can_reach(got.kept, got.n, left, target, confidence):
            t.eliminated_after = len(t.hits)
            out.append(name)
    return out


def _reference(engine, prompt, params, it, tally: Tally):
    """Full prefill on one item: its answer's ids and its logits along them (the reference)."""
    from kvfuse.engine import CacheOptions

    off = CacheOptions(enabled=False)
    ref = engine.generate(prompt.ids, params, cache=off)
    ref_ids = ref.token_ids or [engine.model.tokenizer.eos_token_id or 0]
    (ref_logits,) = engine.score(prompt.ids, [ref_ids], cache=off)
    _record(tally, judge(ref.text, it, ref.text), ref.timings.ttft_s)
    tally.nll.append(nll(ref_logits[: len(ref_ids)], ref_ids))
    return ref.text, ref_ids, ref_logits[: len(ref_ids)]


def _setting(engine, prompt, params, it, opts: BlendOptions, reference, tally: Tally) -> None:
    """One setting on one item: its answer judged, its KL and NLL along full prefill's answer."""
    from kvfuse.engine import CacheOptions

    text, ref_ids, ref_logits = reference
    cache = CacheOptions() if opts.blends else CacheOptions(enabled=False)  # module docstring
    (logits,) = engine.score(prompt, [ref_ids], blend=opts, cache=cache)  # caches the documents
    got = engine.generate(prompt, params, blend=opts, cache=cache)
    _record(tally, judge(got.text, it, text), got.timings.ttft_s)
    tally.kl.append(kl(ref_logits, logits[: len(ref_ids)]))
    tally.nll.append(nll(logits[: len(ref_ids)], ref_ids))


def measure(
    engine,
    items: Sequence[fictional_qa.Item | CalibrationItem],
    configs: dict[str, BlendOptions],
    max_tokens: int = 16,
    progress: Callable[[Progress], None] | None = None,
    chat: bool | None = None,
    target: float | None = None,
    confidence: float = 0.95,
) -> Report:
    """Run ``configs`` and full prefill on ``items`` with ``engine`` (which needs its KV cache);
    ``chat`` None: ``asks_in_chat``.

    With a ``target``, early elimination: after each item, a blend setting that can no longer end
    with a lower bound of answers kept (at ``confidence``) >= ``target`` (``eliminate``) is not
    run on the items left; when none is left, measuring stops (``Report.stopped_after``). The
    choice is the one a full run makes: ``choose`` takes only settings whose lower bound reaches
    the target, which an eliminated one cannot do whatever the items left hold, and every setting
    still running is measured on every item, as is full reuse (the KL reference), which runs
    while any setting does. (Answers and KL are the same numbers as in a full run; TTFT is a
    timing, as noisy as in any run.) Every setting runs on at least one item. Without a target
    (``--measure-all``), every setting runs on every item."""
    from kvfuse.generation import SamplingParams

    chat = asks_in_chat(engine) if chat is None else chat
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=("\n",))
    tallies = {"full prefill": Tally(), **{name: Tally() for name in configs}}
    blends = [name for name, o in configs.items() if not o.full_reuse]
    alive, prompts, n = list(configs), PromptBuilder.for_model(engine.model), 0
    t0 = time.perf_counter()
    for n, it in enumerate(items, 1):
        prompt = item_prompt(prompts, it, chat)
        reference = _reference(engine, prompt, params, it, tallies["full prefill"])
        for name in alive:
            _setting(engine, prompt, params, it, configs[name], reference, tallies[name])
        if target is not None:
            left = len(items) - n
            out = eliminate(tallies, [b for b in blends if b in alive], left, target, confidence)
            alive = [a for a in alive if a not in out]
        running = sum(1 for b in blends if b in alive)
        if progress is not None:
            progress(Progress(n, len(items), time.perf_counter() - t0, running, len(blends)))
        if blends and not running:
            break
    return Report(n, tallies, dict(configs), planned=len(items))
