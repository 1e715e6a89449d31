"""Where calibration questions come from: the fictional generator, MuSiQue dev, the CacheBlend
examples. Each gives ``Example``s (documents, a question, its gold answers) that ``forms`` turns
into prompts of several shapes.

- ``fictional``: ``fictional_qa``'s dev split (items 0-199; the test split is never read here).
  Facts no model knows, one gold answer each.
- ``musique``: ``musique_s.json``, **dev examples 0-49 only** (50-149 are the test split, kept for
  final reports: this module never returns them). Ten real passages each, gold answers with
  aliases.
- ``cacheblend``: the CacheBlend demo prompts ``cacheblend_example_{1..10}.json`` (5-6 real
  passages and a question each). They have **no gold answer**: their reference is full
  prefill's own answer (``Example.answers`` empty; see ``measure``), which is exactly "is the
  answer kept". The data README gives them no split; all ten are used for calibration.

The data folder is ``$KVFUSE_DATA``, else ``../shared/data`` beside the repository (the same rule
as the benchmarks' ``bench/lib/paths.py``, which the package cannot import). Without it only the
fictional source works; asking for another raises ``SourceUnavailable`` saying where it looked.
Every source is deterministic: the same index always gives the same example.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import fictional_qa
from .answers import any_correct

SOURCES = ("fictional", "musique", "cacheblend")
MUSIQUE_DEV = range(0, 50)  # examples 50-149 are the test split: final reports only
CACHEBLEND = range(1, 11)
SPLITS = {
    "fictional": "fictional_qa dev (items 0-199)",
    "musique": "musique_s.json dev (examples 0-49)",
    "cacheblend": "cacheblend_example_1..10 (no split given; no gold answers: full prefill's answer)",
}


class SourceUnavailable(ValueError):
    """A source whose data file is not there (the message says which file and how to point to it)."""


@dataclass(frozen=True)
class Example:
    """One question over documents, before a prompt form is applied. ``answers`` empty: no gold
    answer, full prefill's answer is the reference."""

    source: str
    index: int
    documents: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    # documents a form may not drop when it shows fewer (the ones the answer needs); empty: none
    needed: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """Identity across forms: the holdout split is made on it, so one example is never in both
        parts."""
        return f"{self.source}:{self.index}"


def data_dir() -> Path:
    """``$KVFUSE_DATA``, else ``<repository>/../shared/data``."""
    from kvfuse.config.load import default_data

    return default_data() or Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _file(name: str, folder: Path | None) -> Path:
    path = (folder or data_dir()) / name
    if not path.is_file():
        raise SourceUnavailable(
            f"{path} is not there: the {name.split('_')[0]} source needs the evaluation data folder "
            "(set KVFUSE_DATA to it), or use --sources fictional"
        )
    return path


def fictional(n: int) -> list[Example]:
    """The first ``n`` fictional dev items (10 documents generated; ``forms`` keeps 4-10)."""
    return [
        Example("fictional", it.index, it.documents, it.question, (it.answer,), it.gold_documents)
        for it in fictional_qa.items("dev", min(n, len(fictional_qa.DEV)), 10)
    ]


def musique(n: int, folder: Path | None = None) -> list[Example]:
    """The first ``n`` MuSiQue dev examples (never one of the test split)."""
    rows = json.loads(_file("musique_s.json", folder).read_text())
    out = []
    for i in MUSIQUE_DEV[: max(0, n)]:
        row = rows[i]
        docs = tuple(c["text"].strip() for c in row["ctxs"])
        answers = tuple(row["answers"])
        stating = tuple(k for k, d in enumerate(docs) if any_correct(d, answers))
        out.append(Example("musique", i, docs, row["question"].strip(), answers, stating))
    return out


def parse_cacheblend(data: dict, index: int) -> Example:
    """One CacheBlend demo prompt: its chunks, and the question between "Question:" and
    "Answer:" of its query (the instruction before it is the paper's, not the form's)."""
    docs = tuple(data[str(k)].strip() for k in range(int(data["chunk_num"])))
    found = re.search(r"Question:(.*?)(?:Answer:|$)", data["query"], re.S)
    if not found or not found.group(1).strip():
        raise ValueError(f"cacheblend example {index}: no question in its query")
    # no gold answer to find: every passage is kept (the question may need any of them)
    return Example("cacheblend", index, docs, found.group(1).strip(), (), tuple(range(len(docs))))


def cacheblend(n: int, folder: Path | None = None) -> list[Example]:
    """The first ``n`` CacheBlend examples (1-10)."""
    return [
        parse_cacheblend(json.loads(_file(f"cacheblend_example_{i}.json", folder).read_text()), i)
        for i in CACHEBLEND[: max(0, n)]
    ]


def available(folder: Path | None = None) -> tuple[str, ...]:
    """The sources whose data is there (the fictional one always is)."""
    folder = folder or data_dir()
    have = {
        "musique": (folder / "musique_s.json").is_file(),
        "cacheblend": (folder / "cacheblend_example_1.json").is_file(),
    }
    return tuple(s for s in SOURCES if have.get(s, True))


def examples(sources: Sequence[str], n: int, folder: Path | None = None) -> list[Example]:
    """``n`` examples taken in turn from ``sources`` (one of each, then the next of each, ...;
    a source that runs out leaves its turns to the others): every source is represented even in
    a small run, and the same arguments give the same list."""
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise ValueError(f"unknown source {bad[0] if bad else '(none)'}; use: {', '.join(SOURCES)}")
    load = {"fictional": fictional, "musique": musique, "cacheblend": cacheblend}
    pools = [load[s](n) if s == "fictional" else load[s](n, folder) for s in dict.fromkeys(sources)]
    out: list[Example] = []
    for turn in range(max(map(len, pools))):
        out += [pool[turn] for pool in pools if turn < len(pool)]
    return out[:n]
