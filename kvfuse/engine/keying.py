"""Which keys a request's prompt is served from: its namespace, its chain and documents, and, for a
plain prompt, the stored history it lines up with.

``Keying.sequence(request)`` turns a request into the engine's ``Sequence`` with its keys
computed (hashing only, on the submitting thread). A plain prompt (one prefix segment: a chat or
a completion without documents) is first lined up against the stored history that covers most of
it (``kvfuse.history``: found by ``prompt_cache_key``, by content anchors, or named by the request,
e.g. a Responses API ``previous_response_id``): the prompt then runs with the stored ids wherever
they spell the same text, and its keys name that history's entries for the slots they fill. With
no record, ``probe_tail`` looks for a stored history by content: a tail entry after the chain's
hits (e.g. after a restart, or the partial chunk a cache breakpoint stored).

Keys never mix: the namespace names the model, the KV dtype and layout, the format version, the
tenant and every salt (the engine's, the request's, the blend settings'); a conversation continued
after dropped turns gets a namespace derived from what it was derived from.

A request's blend is resolved here too: ``recompute_ratio: auto`` becomes the model's calibrated
blend (``kvfuse.calibration.profile``), and a prompt whose blend is ``prefix`` (no blending: what
``auto`` picks for a model where blending does not pay) is keyed as a plain prompt, its documents
reused only as part of an exact prefix. With automatic reuse (``auto_reuse``), a plain prompt's
content-defined chunks are keyed too, in the request's plain namespace.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvfuse.blend.options import BlendOptions
from kvfuse.calibration import profile
from kvfuse.config import EngineSettings
from kvfuse.history import Alignment, HistoryIndex, Record, Run, align
from kvfuse.kv import content
from kvfuse.kv.keys import Namespace, layout_of
from kvfuse.models import LoadedModel
from kvfuse.store import TieredStore

from .auto_reuse import AutoReuse
from .planner import prompt_keys, tail_probe
from .prompt import Prompt
from .request import Request
from .saver import Saver
from .sequence import Sequence, SequenceStatus


class Keying:
    """Namespaces and keys of one engine's requests; see the module docstring."""

    def __init__(
        self,
        model: LoadedModel,
        store: TieredStore | None,
        saver: Saver | None,
        settings: EngineSettings,
        history: HistoryIndex | None,
        context_window: int,
    ):
        self.model, self.store, self.saver, self.history = model, store, saver, history
        self.chunk_size = settings.cache.chunk_size
        self.kv_dtype = settings.cache.kv_dtype
        self.salt = settings.cache.salt
        self.allow_gap = (
            settings.cache.truncation == "reuse"
        )  # reuse the kept turns' KV after dropped ones
        folder = Path(settings.profiles_path) if settings.profiles_path else None
        self.profile = profile.find(model.fingerprint, folder)
        self.codec_level = profile.codec_level(
            self.profile
        )  # CacheGen at level 0 writes this (0: the default)
        # the engine's blend, ``auto`` resolved (without a cache there are no documents: nothing to warn of)
        self.blend = profile.resolve(
            settings.blend, self.profile, model.name, warn=store is not None
        )
        self.context_window = context_window
        self.auto = AutoReuse.of(settings.blend)
        c = model.config
        self.layout = layout_of(c.num_layers, c.num_kv_heads, c.head_dim)
        # The bytes each token id spells (None: unknown, ids must then match exactly); read once, lazily.
        self.token_bytes: list[bytes] | tuple | None = None

    def namespace(
        self, tenant: str = "", salt: str = "", blend: BlendOptions | None = None
    ) -> Namespace:
        """The cache namespace of this model/KV format for ``tenant``, inside request ``salt``; with
        ``blend``, the namespace of prompts blended with those options (``BlendOptions.identity``)."""
        full_salt = (
            self.salt
            + ("\x00" + salt if salt else "")
            + ("\x00" + blend.identity() if blend else "")
        )
        return Namespace(
            tenant=tenant,
            model_fingerprint=self.model.fingerprint,
            kv_dtype=self.kv_dtype,
            kv_layout=self.layout,
            salt=full_salt,
        )

    def document_context(
        self, blend: BlendOptions | None = None, prompt_prefix: Seq[int] | None = None
    ) -> tuple[int, ...]:
        """What documents' KV is computed behind when cached on their own (``document_context``):
        the model's BOS token (``bos``, when it has one), its end-of-text token (``eos``), the
        prompt's own prefix (``prefix``: the tokens before the first document), or nothing."""
        mode = (blend or self.blend).document_context
        tok = self.model.tokenizer
        if mode == "prefix":
            if prompt_prefix is None:
                raise ValueError(
                    "document_context 'prefix' computes documents behind each prompt's prefix: "
                    "give the prefix"
                )
            return tuple(prompt_prefix)
        token = tok.bos_token_id if mode == "bos" else tok.eos_token_id if mode == "eos" else None
        return (token,) if token is not None else ()

    @functools.cached_property
    def separators(self) -> np.ndarray | None:
        """The ids whose text ends with a line break, where content chunks start segments (None:
        the tokenizer's bytes are unknown; content chunks are then cut by the hash rule alone)."""
        table = self.model.tokenizer.token_bytes()
        return content.separator_ids(table) if table is not None else None

    def resolve(self, blend: BlendOptions | None) -> BlendOptions:
        """``blend`` (None: the engine's) with an ``auto`` budget replaced by the model's profile's."""
        if blend is None:
            return self.blend
        return profile.resolve(blend, self.profile, self.model.name)

    def sequence(self, request: Request) -> Sequence:
        """``request``'s sequence, with its keys computed (hashing only)."""
        documents = bool(request.prompt.documents)
        request.blend = self.resolve(request.blend)
        if documents and not request.blend.blends:  # no blending: the documents are prompt text
            request.prompt = Prompt.plain(request.prompt.ids)
        auto = self.auto.status(
            request.cache,
            request.blend,
            cached=self.store is not None and request.cache.enabled,
            plain=not documents and request.prompt.is_prefix_only,
        )
        seq = self._sequence(request, request.blend)
        seq.documents, seq.auto = documents, auto
        if (
            auto == "on"
        ):  # the prompt as it runs (lined up with a history), keyed in the plain namespace
            c = request.cache
            seq.keys = self.auto.with_content(
                seq.keys, request.prompt.ids, self.namespace(c.tenant, c.salt), self.separators
            )
        return seq

    def _sequence(self, request: Request, blend: BlendOptions) -> Sequence:
        if self.store is None or not request.cache.enabled:
            return Sequence(request, None, None, blend)
        c = request.cache
        ns = self.namespace(c.tenant, c.salt)
        if self.history is not None and request.prompt.is_prefix_only:
            return self._lined_up(request, ns, blend)
        blend_ns = self.namespace(c.tenant, c.salt, blend) if blend.store_blended else None
        keys = prompt_keys(
            request.prompt,
            self.chunk_size,
            ns,
            self.document_context(blend, request.prompt.prefix),
            blend_ns,
            chain_over_suffix=blend.query_aware,
        )
        return Sequence(request, ns, keys, blend)

    def _best_record(self, request: Request, scope: str) -> tuple[Record, Alignment] | None:
        """The stored history that lines up with most of the prompt, and how."""
        if self.token_bytes is None:
            self.token_bytes = self.model.tokenizer.token_bytes() or ()
        table = self.token_bytes or None
        candidates = self.history.candidates(scope, request.prompt.ids, request.cache.history_key)
        hint = request.cache.history_hint
        if (
            hint is not None and hint.scope == scope
        ):  # e.g. a previous_response_id's history: tried first
            candidates.insert(0, hint)
        best = None
        for rec in candidates:
            al = align(rec.ids.tolist(), request.prompt.ids, table, allow_gap=self.allow_gap)
            if al.reusable and (best is None or al.reusable > best[1].reusable):
                best = (rec, al)
        return best

    def _lined_up(self, request: Request, ns: Namespace, blend: BlendOptions) -> Sequence:
        """A plain prompt lined up against the stored history that covers most of it: the prompt
        runs with the stored ids where they spell the same text, its keys name that history's
        entries for the slots they fill."""
        scope = ns.key_prefix()
        best = self._best_record(request, scope)
        seq_ns, record, entries, runs = ns, None, (), ()
        if best is not None and len(best[1].ids) + request.params.max_tokens <= self.context_window:
            record, al = best
            request.prompt = Prompt.plain(al.ids)
            seq_ns = derived_namespace(record, al) if al.moved else record.namespace
            entries, runs = record.entries, al.runs
        keys = prompt_keys(request.prompt, self.chunk_size, seq_ns).with_history(entries, runs)
        seq = Sequence(request, seq_ns, keys, blend, record=record, scope=scope)
        if (
            record is None
        ):  # found by content, if at all: known now, so that the queue can prefetch it
            self.probe_tail(seq, self.store.lookup(keys.all(), count=False).where)
        return seq

    def probe_tail(self, seq: Sequence, where: tuple) -> tuple:
        """No record of a stored history lines up with this prompt (e.g. after a restart): look
        for one by content, a tail entry after the chain's hits, longest first. Returns ``where``
        with the found entry's tier appended (``seq.keys`` then name it), or as it was."""
        keys, ids = seq.keys, seq.request.prompt.ids
        hits = next(
            (i for i, w in enumerate(where[: len(keys.prefix)]) if w is None), len(keys.prefix)
        )
        if hits * self.chunk_size >= len(ids):
            return where
        probe = tail_probe(ids, keys.prefix, hits, self.chunk_size, seq.namespace)
        if self.saver is not None and seq.status is SequenceStatus.RUNNING:
            self.saver.wait(e.key for e in probe)
        found = self.store.lookup([e.key for e in probe], count=False).where
        for entry, tier in zip(probe, found):
            if tier is not None:
                end = min(entry.source + entry.tokens, len(ids))
                seq.keys = keys.with_history([entry], [Run(entry.source, end, entry.source)])
                return tuple(where) + (tier,)
        return where


def derived_namespace(record: Record, al: Alignment) -> Namespace:
    """The namespace of a conversation continued after its oldest turns were dropped with the KV
    kept (moved runs): its KV is not a plain prefill's, so it never shares keys with one. Named by
    what it was derived from, so the same truncation gives the same namespace."""
    end = max(r.source + len(r) for r in al.runs)
    h = hashlib.sha256(record.namespace.short_id().encode())
    h.update(np.ascontiguousarray(record.ids[:end], dtype="<u4").tobytes())
    for r in al.runs:
        h.update(struct.pack("<QQQ", r.start, r.end, r.source))
    return replace(
        record.namespace, salt=record.namespace.salt + "\x00history:" + h.hexdigest()[:32]
    )
