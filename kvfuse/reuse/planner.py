"""The planner: a prompt's segments + where the tiers hold its keys -> a ``Plan``. Pure functions.

A plan says, per span of the prompt (a span's cache slots are its positions in the prompt):

- ``Load``: take the entry ``key`` (from the tier lookup named) into slots ``[start, end)``; its
  keys were stored at positions ``source..`` and are moved to ``start..`` (exact RoPE
  re-rotation; a no-op for prefix chunks, whose positions never change);
- ``Precompute``: compute a document that no tier holds on its own, store it under its key, and
  then load it like a hit (a ``Load`` with ``tier=None`` follows it);
- ``Compute``: run the model over ``[start, end)`` in the prompt's context, writing those slots
  (whatever a load put there is replaced);
- ``Save``: after computing, save slots ``[start, end)`` under ``key``.

The engine carries a plan out and does nothing the plan does not say. Entries that lookup found
but that turn out unusable when fetched are planned around with :func:`replan`: the same inputs
with those keys marked missing. Everything here is a pure function of its arguments, so the
planner is tested with exact expected plans (``tests/unit/test_planner.py``), no model needed.

Rules:

- prefix chunks are reused as the longest run of hits from the first chunk (a chain: chunk i is
  only valid after chunks 0..i-1), and only whole chunks; the rest of the prefix is computed and
  its whole chunks that no tier holds are stored;
- the prompt's last token is always computed: its logits give the first generated token. A plain
  prompt loads every hit, even one covering its last token, and computes that token again (a
  compute replaces what a load put in its slot); a prompt ending in a document recomputes that
  document's last token;
- a plain prompt lined up with a stored history (``PromptKeys.history`` and ``runs``, from
  ``kvfuse.history``) loads that history's entries over the slots after the chain's hits, a span
  of an entry where only part of it lines up (``Load.offset``), moved where the run says the
  tokens were stored elsewhere (turns dropped before them); slots no entry covers are computed;
- documents are loaded whenever an entry exists, else precomputed once per distinct document;
- the suffix is always computed and never stored;
- a prompt with documents also has a *blended chain*: prefix keys over everything before the
  suffix, in a namespace of the blend settings. When all its chunks are stored (the same
  documents were blended before, with whatever question), the prompt is planned as a plain
  prefix hit on them; otherwise the blend's result is stored under them;
- a plain prompt with *content chunks* (``PromptKeys.content``: automatic reuse, ``kv/content.py``)
  also loads the chunks found in a tier after the slots its chain's hits and stored history fill
  (``found``: where each chunk is; a chunk covering the last token is never used): *found
  spans*, moved from wherever they were stored (``Load.source`` None: as the entry says) and
  blended like documents, the slots between them computed in the blend. Its prefix chunks after
  the first found span hold blended KV: they are not stored; its content chunks that were not
  found are (``PromptKeys.store_content``; the saver skips those some tier holds).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from kvfuse.history.align import Run
from kvfuse.history.records import StoredEntry
from kvfuse.kv.keys import ChunkKey, ChunkKind, Namespace, document_key, prefix_keys, tail_key
from kvfuse.prompts.prompt import Prompt, SegmentKind

BLENDED = (ChunkKind.DOCUMENT, ChunkKind.CONTENT)  # loads a blend fuses: documents and found spans


@dataclass(frozen=True)
class Load:
    key: ChunkKey
    tier: str | None  # where lookup found it; None: made by this plan's Precompute
    start: int
    end: int
    # the position the entry's first token was stored at (None: as the entry says)
    source: int | None
    offset: int = 0  # the entry's first token used (a span of a longer stored history)
    entry_tokens: int | None = None  # tokens the entry holds (None: end - start)

    @property
    def moved(self) -> bool:
        return self.source is None or self.source + self.offset != self.start

    @property
    def stored_tokens(self) -> int:
        return self.end - self.start if self.entry_tokens is None else self.entry_tokens


@dataclass(frozen=True)
class Precompute:
    key: ChunkKey
    ids: tuple[int, ...]
    context: tuple[int, ...] = ()  # tokens it is computed behind (e.g. BOS), not part of the entry


@dataclass(frozen=True)
class Compute:
    start: int
    end: int


@dataclass(frozen=True)
class Save:
    key: ChunkKey
    start: int
    end: int


@dataclass(frozen=True)
class Plan:
    num_tokens: int
    precomputes: tuple[Precompute, ...] = ()
    loads: tuple[Load, ...] = ()
    computes: tuple[Compute, ...] = ()
    saves: tuple[Save, ...] = ()

    def in_order(self) -> list[Load | Compute]:
        """Loads and computes by first slot, loads first on a tie: each step then only needs the
        slots before it, and a compute replaces what a load put in its slots."""
        steps: list[Load | Compute] = [*self.loads, *self.computes]
        return sorted(steps, key=lambda s: (s.start, isinstance(s, Compute)))

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV comes from a stored entry (loaded, not computed for this request)."""
        return self.reused_by(lambda load: True)

    def reused_by(self, which) -> int:
        """Prompt tokens whose KV comes from the stored entries of the loads ``which(load)`` picks."""
        covered = [False] * self.num_tokens
        for load in self.loads:
            if load.tier is not None and which(load):
                covered[load.start : load.end] = [True] * (load.end - load.start)
        for c in self.computes:
            covered[c.start : c.end] = [False] * (c.end - c.start)
        return sum(covered)

    @property
    def has_documents(self) -> bool:
        return any(load.key.kind is ChunkKind.DOCUMENT for load in self.loads)

    @property
    def blended(self) -> bool:
        """Whether the plan is executed as a blend: it loads documents or found spans."""
        return any(load.key.kind in BLENDED for load in self.loads)

    @property
    def found_spans(self) -> tuple[Load, ...]:
        """The content chunks found at other positions that it loads (automatic reuse)."""
        return tuple(x for x in self.loads if x.key.kind is ChunkKind.CONTENT)

    @property
    def computed_tokens(self) -> int:
        return sum(c.end - c.start for c in self.computes)


@dataclass(frozen=True)
class ContentChunk:
    """A content-defined chunk of a prompt (``kv/content.py``): slots ``[start, end)``, its key."""

    key: ChunkKey
    start: int
    end: int


@dataclass(frozen=True)
class PromptKeys:
    """Every key a prompt can be served from: its prefix chunks' chain, one key per document, and
    (automatic reuse) its content chunks, looked up separately (``content_lookups``)."""

    chunk_size: int
    prefix: tuple[ChunkKey, ...]
    documents: tuple[ChunkKey, ...]
    document_context: tuple[int, ...] = ()
    blended: tuple[ChunkKey, ...] = ()  # the blended chain (see the module docstring)
    history: tuple[StoredEntry, ...] = ()  # entries of a stored history this prompt lines up with
    runs: tuple[Run, ...] = ()  # the slots those entries' tokens fill (``kvfuse.history.align``)
    content: tuple[ContentChunk, ...] = ()  # content-defined chunks (automatic reuse on), in order
    store_content: bool = False  # save the content chunks no tier was found to hold

    def all(self) -> list[ChunkKey]:
        """The keys to look up, prefix chunks first (their order is the lookup's hit order); not
        the content chunks (see ``content_lookups``)."""
        return (
            list(self.prefix)
            + list(self.documents)
            + list(self.blended)
            + [e.key for e in self.history]
        )

    def with_history(self, entries: Sequence[StoredEntry], runs: Sequence[Run]) -> PromptKeys:
        """These keys and a stored history's entries (those not in the prefix chain already)."""
        chain = set(self.prefix)
        return replace(
            self, history=tuple(e for e in entries if e.key not in chain), runs=tuple(runs)
        )


def suffix_start(prompt: Prompt) -> int:
    """Where the always-computed tail of a prompt starts: its suffix, or its last token."""
    last = prompt.segments[-1]
    return len(prompt) - (len(last) if last.kind is SegmentKind.SUFFIX else 1)


def prompt_keys(
    prompt: Prompt,
    chunk_size: int,
    namespace: Namespace,
    document_context: Sequence[int] = (),
    blend_namespace: Namespace | None = None,
    chain_over_suffix: bool = False,
) -> PromptKeys:
    """The keys of ``prompt``'s prefix chunks and documents in ``namespace`` (hashing only), and
    its blended chain in ``blend_namespace`` when given and the prompt has documents: over
    everything before the suffix; with ``chain_over_suffix`` (a blend that depends on the
    question) in a namespace of that suffix too."""
    blended = ()
    if blend_namespace is not None and prompt.documents:
        start = suffix_start(prompt)
        if chain_over_suffix:
            digest = hashlib.sha256(
                struct.pack(f"<{len(prompt) - start}I", *prompt.ids[start:])
            ).hexdigest()
            blend_namespace = replace(
                blend_namespace, salt=blend_namespace.salt + "\x00question:" + digest
            )
        blended = tuple(prefix_keys(prompt.ids[:start], chunk_size, blend_namespace))
    return PromptKeys(
        chunk_size,
        tuple(prefix_keys(prompt.prefix, chunk_size, namespace)),
        tuple(document_key(ids, namespace, document_context) for _, ids in prompt.documents),
        tuple(document_context),
        blended,
    )


def make_plan(
    prompt: Prompt, keys: PromptKeys, where: Sequence[str | None], found: Sequence[str | None] = ()
) -> Plan:
    """The plan for ``prompt`` given ``where[i]``, the tier holding ``keys.all()[i]`` (None: none),
    and ``found[i]``, the tier holding content chunk ``keys.content[i]`` (None, or no ``found``:
    not looked up, or nowhere)."""
    all_keys = keys.all()
    if len(where) != len(all_keys):
        raise ValueError(f"{len(all_keys)} keys but {len(where)} lookup answers")
    n, ch = len(prompt), keys.chunk_size
    n_pre, n_doc, n_bl = len(keys.prefix), len(keys.documents), len(keys.blended)
    prefix_where = list(where[:n_pre])
    doc_where = list(where[n_pre : n_pre + n_doc])
    blended_where = list(where[n_pre + n_doc : n_pre + n_doc + n_bl])
    history_where = list(where[n_pre + n_doc + n_bl :])
    # blended before: an exact prefix hit
    if blended_where and all(w is not None for w in blended_where):
        loads = tuple(
            Load(k, w, i * ch, (i + 1) * ch, i * ch)
            for i, (k, w) in enumerate(zip(keys.blended, blended_where))
        )
        return Plan(n, loads=loads, computes=(Compute(len(loads) * ch, n),))
    p = len(prompt.prefix)
    if p == n:
        return _plain_plan(
            n, keys, prefix_where, history_where, list(found) or [None] * len(keys.content)
        )

    hits = _chain_hits(prefix_where)
    loadable = min(hits, (n - 1) // ch) if p == n else hits  # the last token must be computed
    loads = [
        Load(keys.prefix[i], prefix_where[i], i * ch, (i + 1) * ch, i * ch) for i in range(loadable)
    ]
    computes = [Compute(loadable * ch, p)] if loadable * ch < p else []
    saves = [
        Save(keys.prefix[i], i * ch, (i + 1) * ch)
        for i in range(loadable, len(keys.prefix))
        if prefix_where[i] is None
    ]

    precomputes: list[Precompute] = []
    planned: set[ChunkKey] = set()
    source = len(keys.document_context)
    for (offset, ids), key, tier in zip(prompt.documents, keys.documents, doc_where):
        if tier is None and key not in planned:
            precomputes.append(Precompute(key, ids, keys.document_context))
            planned.add(key)
        loads.append(Load(key, tier, offset, offset + len(ids), source))

    if prompt.documents:
        computes.append(Compute(suffix_start(prompt), n))
        # after the blend
        saves += [Save(k, i * ch, (i + 1) * ch) for i, k in enumerate(keys.blended)]
    elif prompt.segments[-1].kind is SegmentKind.SUFFIX:
        computes.append(Compute(suffix_start(prompt), n))
    return Plan(n, tuple(precomputes), tuple(loads), tuple(computes), tuple(saves))


def _chain_hits(prefix_where: Sequence[str | None]) -> int:
    """How many prefix chunks hit in a row from the first (a chain: a later hit after a miss is no use)."""
    return next((i for i, w in enumerate(prefix_where) if w is None), len(prefix_where))


def _plain_plan(
    n: int, keys: PromptKeys, prefix_where: list, history_where: list, found: list
) -> Plan:
    """A prompt without documents or suffix: the chain's hits, then a stored history's entries
    over the slots they line up with, then found spans after those; computes for every slot left
    and for the last token (its logits give the first token; a compute replaces what a load put
    in its slot)."""
    ch = keys.chunk_size
    hits = _chain_hits(prefix_where)
    loads = _exact_loads(keys, hits, prefix_where, history_where)
    spans = found_spans(keys.content, found, max((x.end for x in loads), default=0), n)
    loads = sorted(loads + spans, key=lambda x: x.start)
    region = spans[0].start if spans else n  # KV after a found span is blended: not a prefill's
    saves = [
        Save(keys.prefix[i], i * ch, (i + 1) * ch)
        for i in range(hits, len(keys.prefix))
        if prefix_where[i] is None and (i + 1) * ch <= region
    ]
    if keys.store_content:
        saves += [
            Save(c.key, c.start, c.end) for c, tier in zip(keys.content, found) if tier is None
        ]
    return Plan(n, loads=tuple(loads), computes=tuple(_uncovered(n, loads)), saves=tuple(saves))


def _exact_loads(
    keys: PromptKeys, hits: int, prefix_where: list, history_where: list
) -> list[Load]:
    """The chain's ``hits``, then a stored history's entries over the slots its runs line up with
    (a span of an entry where only part of it does), after the slots the loads before cover."""
    ch = keys.chunk_size
    loads = [
        Load(keys.prefix[i], prefix_where[i], i * ch, (i + 1) * ch, i * ch) for i in range(hits)
    ]
    covered = hits * ch
    for run in keys.runs:
        for e, tier in zip(keys.history, history_where):
            a, b = max(run.source, e.source), min(run.source + len(run), e.source + e.tokens)
            if tier is None or a >= b:
                continue
            s0, s1 = run.start + a - run.source, run.start + b - run.source
            if s1 <= covered:
                continue
            a += max(0, covered - s0)
            s0 = max(s0, covered)
            loads.append(Load(e.key, tier, s0, s1, e.source, a - e.source, e.tokens))
    return sorted(loads, key=lambda x: x.start)


def _uncovered(n: int, loads: Sequence[Load]) -> list[Compute]:
    """Computes for the slots no load fills, and for the last one (its logits are needed)."""
    slot = [False] * n
    for x in loads:
        slot[x.start : x.end] = [True] * (x.end - x.start)
    slot[n - 1] = False
    computes, i = [], 0
    while i < n:
        if slot[i]:
            i += 1
            continue
        j = i
        while j < n and not slot[j]:
            j += 1
        computes.append(Compute(i, j))
        i = j
    return computes


def found_spans(
    content: Sequence[ContentChunk], found: Sequence[str | None], after: int, n: int
) -> list[Load]:
    """Loads of the content chunks found in a tier (``found[i]``) that start at or after slot
    ``after`` (what exact loads fill) and leave the prompt's last token (of ``n``) to compute:
    moved from wherever their entries were stored (``source`` None)."""
    return [
        Load(c.key, tier, c.start, c.end, None)
        for c, tier in zip(content, found)
        if tier is not None and c.start >= after and c.end <= n - 1
    ]


def content_lookups(keys: PromptKeys, where: Sequence[str | None]) -> list[int]:
    """Which of ``keys.content`` are worth looking up given ``where`` (the lookup of
    ``keys.all()``): the chunks after the chain's hits that do not hold the last token."""
    if not keys.content:
        return []
    start = _chain_hits(where[: len(keys.prefix)]) * keys.chunk_size
    n = keys.content[-1].end
    return [i for i, c in enumerate(keys.content) if c.start >= start and c.end <= n - 1]


def tail_probe(
    ids: Sequence[int], chain: Sequence[ChunkKey], hits: int, chunk_size: int, namespace: Namespace
) -> list[StoredEntry]:
    """The tail keys a stored history could have after the ``hits`` chunks of ``ids`` that the
    tiers hold, for every length up to the next chunk boundary (or the prompt's end), longest
    first: a history found by content alone (no record of its ids, e.g. after a restart)."""
    start = hits * chunk_size
    parent = chain[hits - 1] if hits else None
    longest = min(chunk_size - 1, len(ids) - start)
    return [
        StoredEntry(tail_key(parent, ids[start : start + t], namespace), start, t)
        for t in range(longest, 0, -1)
    ]


def history_entries(ids: Sequence[int], chunk_size: int, namespace: Namespace) -> list[StoredEntry]:
    """Where a history of ``ids`` is stored: its whole chunks under the prefix chain, and the
    partial last chunk as a tail entry after the chain (``tail_key``)."""
    chain = prefix_keys(list(ids), chunk_size, namespace)
    out = [StoredEntry(k, i * chunk_size, chunk_size) for i, k in enumerate(chain)]
    rest = len(ids) - len(chain) * chunk_size
    if rest:
        start = len(chain) * chunk_size
        out.append(
            StoredEntry(tail_key(chain[-1] if chain else None, ids[start:], namespace), start, rest)
        )
    return out


def breakpoint_saves(
    ids: Sequence[int],
    chain: Sequence[ChunkKey],
    breakpoints: Sequence,
    chunk_size: int,
    namespace: Namespace,
    planned: set[ChunkKey] = frozenset(),
) -> list[Save]:
    """What a prompt's cache breakpoints add to its saves: at each breakpoint position ``b`` that
    is inside the prompt and not on a chunk boundary, the partial chunk ``[b - b % chunk_size, b)``
    as a tail entry after the chain (the key ``tail_probe`` finds for a later prompt with the same
    first ``b`` tokens). A boundary needs nothing: the whole chunk before it is an entry already."""
    return tail_saves(
        ids, chain, {bp.position for bp in breakpoints}, chunk_size, namespace, planned
    )


def tail_saves(
    ids: Sequence[int],
    chain: Sequence[ChunkKey],
    positions: Iterable[int],
    chunk_size: int,
    namespace: Namespace,
    planned: set[ChunkKey] = frozenset(),
) -> list[Save]:
    """The partial chunks ``[b - b % chunk_size, b)`` of a prompt's ``ids`` ending at each of
    ``positions`` inside it and off a chunk boundary, as tail entries after the ``chain``, less
    those ``planned`` already (``breakpoint_saves``; the prompt's own last partial chunk, which a
    server publishing KV events saves at prefill so that routers see it while the answer runs)."""
    out: list[Save] = []
    for b in sorted(set(positions)):
        k = b // chunk_size
        if b > len(ids) or b % chunk_size == 0 or k > len(chain):
            continue
        key = tail_key(chain[k - 1] if k else None, list(ids[k * chunk_size : b]), namespace)
        if key not in planned:
            out.append(Save(key, k * chunk_size, b))
    return out


def full_prefill(prompt: Prompt) -> Plan:
    """The plan without a cache: compute every token, store nothing."""
    return Plan(len(prompt), computes=(Compute(0, len(prompt)),))


def replan(
    prompt: Prompt,
    keys: PromptKeys,
    where: Sequence[str | None],
    unusable: set[ChunkKey],
    found: Sequence[str | None] = (),
) -> Plan:
    """The plan after fetching: ``unusable`` keys (missing or damaged when read) count as misses."""
    return make_plan(
        prompt,
        keys,
        [None if k in unusable else w for k, w in zip(keys.all(), where)],
        [None if c.key in unusable else f for c, f in zip(keys.content, found)],
    )


def generated_saves(
    ids: Sequence[int], kv_length: int, chunk_size: int, namespace: Namespace, first_chunk: int
) -> list[Save]:
    """Stores for the whole chunks ``first_chunk..`` of ``ids`` (prompt + generated tokens) whose
    KV is in the cache (``kv_length`` slots): a follow-up turn then reuses the answer too."""
    keys = prefix_keys(list(ids[:kv_length]), chunk_size, namespace)
    return [
        Save(k, i * chunk_size, (i + 1) * chunk_size)
        for i, k in enumerate(keys)
        if i >= first_chunk
    ]
