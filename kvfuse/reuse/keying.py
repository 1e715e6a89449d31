"""Which keys a request's prompt is served from: its namespace, its chain and documents, and, for a
plain prompt, the stored history it lines up with.

``Keying.key(...)`` turns a request into its ``Reuse`` with its keys computed (hashing only, on
the submitting thread; no store is asked until the sequence is planned). A plain prompt (one prefix segment: a chat or
a completion without documents) is first lined up against the stored history that covers most of
it (``kvfuse.history``: found by ``prompt_cache_key``, by content anchors, or named by the request,
e.g. a Responses API ``previous_response_id``): the prompt then runs with the stored ids wherever
they spell the same text, and its keys name that history's entries for the slots they fill. With
no record, ``probe_tail`` looks for a stored history by content: a tail entry after the chain's
hits (e.g. after a restart, or the partial chunk a cache breakpoint stored); on submit (so that
the queue can prefetch it), and again when the sequence is planned only if a save landed since.

Keys never mix: the namespace names the model, the KV dtype and layout, the format version, the
tenant and every salt (the engine's, the request's, the blend settings'); a conversation continued
after dropped turns gets a namespace derived from what it was derived from. Every namespace derived
from a request's ``cache_salt`` keeps that salt (``Namespace.cache_salt``), whose tag prefixes its
keys: deleting the salt (``DELETE /v1/kv?cache_salt=``) covers the blended and history-derived
namespaces too.

A request's blend is resolved here too: ``recompute_ratio: auto`` becomes the model's calibrated
blend (``kvfuse.config.profiles``), and a prompt whose blend is ``prefix`` (no blending: what
``auto`` picks for a model where blending does not pay) is keyed as a plain prompt, its documents
reused only as part of an exact prefix. With automatic reuse (``auto_reuse``), a plain prompt's
content-defined chunks are keyed too, in the request's plain namespace.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import threading
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvfuse import dtypes
from kvfuse.blend.options import BlendOptions
from kvfuse.config import EngineSettings
from kvfuse.config import profiles as profile
from kvfuse.history import Alignment, HistoryIndex, Record, Run, align
from kvfuse.kv import content
from kvfuse.kv.keys import Namespace, layout_of
from kvfuse.models import LoadedModel
from kvfuse.models.cache import slot_bytes
from kvfuse.prompts.prompt import Prompt
from kvfuse.store import TieredStore

from .auto_reuse import AutoReuse
from .guard import BlendGuard
from .options import CacheOptions
from .planner import prompt_keys, tail_probe
from .saver import Saver
from .state import Reuse


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
        # reuse the kept turns' KV after dropped ones
        self.allow_gap = settings.cache.truncation == "reuse"
        folder = Path(settings.profiles_path) if settings.profiles_path else None
        self.profile = profile.find(model.fingerprint, folder)
        # CacheGen at level 0 writes this (0: the default)
        self.codec_level = profile.codec_level(self.profile)
        # and K's outlier channels divided down above this (None: not; CacheGenCodec.k_cap)
        self.codec_k_cap = profile.codec_k_cap(self.profile)
        # the engine's blend, ``auto`` resolved (without a cache there are no documents: nothing to warn of)
        self.blend = profile.resolve(
            settings.blend, self.profile, model.name, warn=store is not None
        )
        self.context_window = context_window
        # The live KV the engine's budget can ever hold, in slots (None: unbounded): an aligned
        # prompt is adopted only if it still fits, since it can be longer than the one sent.
        limit = settings.engine.kv_memory_bytes
        self.max_live_tokens = (
            None
            if limit is None
            else limit // slot_bytes(model.config, dtypes.torch_dtype(self.kv_dtype))
        )
        self.auto = AutoReuse.of(settings.blend)
        c = model.config
        self.layout = layout_of(c.num_layers, c.num_kv_heads, c.head_dim)
        self.guard = BlendGuard(settings.blend, model.name)  # the online guard (verify_rate)
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
            cache_salt=salt,  # its tag prefixes the blended and history-derived ones too
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

    def key(
        self,
        prompt: Prompt,
        cache: CacheOptions,
        blend: BlendOptions | None,
        max_tokens: int,
        request_id: str = "",
        cancel: threading.Event | None = None,
    ) -> Reuse:
        """A request's ``Reuse``: its blend resolved, its prompt as it will run, its keys
        (hashing only; no store is asked)."""
        documents = bool(prompt.documents)
        wanted = self.resolve(blend)
        blend = self.guard.apply(wanted)
        if documents and not blend.blends:  # no blending: the documents are prompt text
            prompt = Prompt.plain(prompt.ids)
        r = Reuse(request_id, prompt, cache, blend, documents=documents)
        if blend is not wanted:
            r.shadow = wanted
        if cancel is not None:
            r.cancel = cancel
        r.auto = self.auto.status(
            cache,
            blend,
            cached=self.store is not None and cache.enabled,
            plain=not documents and prompt.is_prefix_only,
        )
        if self.store is None or not cache.enabled:
            return r
        r.namespace = self.namespace(cache.tenant, cache.salt)
        if self.history is not None and prompt.is_prefix_only:
            self._line_up(r, max_tokens)
        else:
            blend_ns = (
                self.namespace(cache.tenant, cache.salt, blend) if blend.store_blended else None
            )
            context = self.document_context(blend, prompt.prefix)
            r.keys = prompt_keys(
                prompt, self.chunk_size, r.namespace, context, blend_ns, blend.query_aware
            )
        if r.auto == "on":  # the prompt as it runs, keyed in the plain namespace
            plain = self.namespace(cache.tenant, cache.salt)
            r.keys = self.auto.with_content(r.keys, r.prompt.ids, plain, self.separators)
        return r

    def _best_record(self, r: Reuse) -> tuple[Record, Alignment] | None:
        """The stored history that lines up with most of the prompt, and how."""
        if self.token_bytes is None:
            self.token_bytes = self.model.tokenizer.token_bytes() or ()
        table = self.token_bytes or None
        hint = r.cache.history_hint
        # A request that names its conversation is lined up with that only (and is told its
        # reuse exactly: server.disclosure); others are found by content within the scope.
        named = r.cache.history_key is not None or hint is not None
        candidates = self.history.candidates(
            r.scope, r.prompt.ids, r.cache.history_key, by_content=not named
        )
        # e.g. a previous_response_id's history: tried first
        if hint is not None and hint.scope == r.scope:
            candidates.insert(0, hint)
        best = None
        for rec in candidates:
            al = align(rec.ids.tolist(), r.prompt.ids, table, allow_gap=self.allow_gap)
            if al.reusable and (best is None or al.reusable > best[1].reusable):
                best = (rec, al)
        return best

    def _line_up(self, r: Reuse, max_tokens: int) -> None:
        """A plain prompt lined up against the stored history that covers most of it: the prompt
        runs with the stored ids where they spell the same text, its keys name that history's
        entries for the slots they fill. With no record, the planning looks for a stored history
        by content (``probe_tail``), once, after the pending saves."""
        r.scope = history_scope(r.namespace, r.cache.user)
        best = self._best_record(r)
        entries, runs = (), ()
        if best is not None and self._fits(len(best[1].ids) + max_tokens):
            r.record, al = best
            r.prompt = Prompt.plain(al.ids)
            r.namespace = derived_namespace(r.record, al) if al.moved else r.record.namespace
            entries, runs = r.record.entries, al.runs
        r.keys = prompt_keys(r.prompt, self.chunk_size, r.namespace).with_history(entries, runs)
        if r.record is None:  # found by content, if at all: known now, so that the queue can
            # prefetch it; probed again when planned only if a save landed in between
            r.probed = self.saver.epoch
            self.probe_tail(r, self.store.lookup(r.keys.all(), count=False).where, wait=False)

    def _fits(self, tokens: int) -> bool:
        """Whether a prompt and answer of ``tokens`` fit the context window and the whole KV
        budget: an alignment runs the stored ids, which can be more tokens than the prompt sent
        (a history tokenized otherwise), and must not turn a request that fits into one that can
        never be admitted."""
        live = self.max_live_tokens
        return tokens <= self.context_window and (live is None or tokens <= live)

    def probe_tail(self, r: Reuse, where: tuple, wait: bool = True) -> tuple:
        """No record of a stored history lines up with this prompt (e.g. after a restart): look
        for one by content, a tail entry after the chain's hits, longest first. Returns ``where``
        with the found entry's tier appended (``r.keys`` then name it), or as it was."""
        keys, ids = r.keys, r.prompt.ids
        hits = next(
            (i for i, w in enumerate(where[: len(keys.prefix)]) if w is None), len(keys.prefix)
        )
        if hits * self.chunk_size >= len(ids):
            return where
        probe = tail_probe(ids, keys.prefix, hits, self.chunk_size, r.namespace)
        if wait:
            self.saver.wait(e.key for e in probe)
        found = self.store.lookup([e.key for e in probe], count=False).where
        for entry, tier in zip(probe, found):
            if tier is not None:
                end = min(entry.source + entry.tokens, len(ids))
                r.keys = keys.with_history([entry], [Run(entry.source, end, entry.source)])
                return tuple(where) + (tier,)
        return where


def history_scope(namespace: Namespace, user: str | None) -> str:
    """Where a request's history records go and are looked for: its namespace's key prefix, and
    within it its end user's own (OpenAI's ``user``, hashed): one user's conversations are never
    lined up with another's. Clearing a tenant or namespace (a key-prefix delete) covers them."""
    scope = namespace.key_prefix()
    if not user:
        return scope
    return (
        scope + "\x00user:" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    )


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
