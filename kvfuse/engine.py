"""The engine: plan (look up the prompt's chunks) -> load the hits -> prefill the rest -> decode -> store.

``Engine.generate`` is the one call the CLI and the server make. It reuses the KV of the longest
cached prefix of the prompt (whole chunks, from whichever tier holds them), prefills only the
rest, stores the new full chunks (memory synchronously, lower tiers in the background), and
decodes. Greedy output with a cache hit is token-for-token the output without a cache: the live
KV cache has the stored dtype, so a loaded chunk holds exactly what a prefill would have written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .codecs import get_codec
from .generation import Sampler, SamplingParams, StopMatcher
from .kv.format import FormatError, decode_chunk, encode_entry
from .kv.keys import Namespace, layout_of, prefix_keys
from .models import LoadedModel
from .models.cache import KVCache
from .models.tokenizer import StreamDecoder
from .tiers.store import TieredStore

log = logging.getLogger(__name__)

KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class CacheOptions:
    """Per-request cache behaviour: the server maps an API key's tenant onto ``tenant`` and the
    request's ``cache_salt`` onto ``salt``; tenants never share entries."""

    enabled: bool = True
    tenant: str = ""
    salt: str = ""
    store_generated: bool | None = None  # None -> the engine's default


@dataclass
class Timings:
    queued_s: float = 0.0
    lookup_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # request start (after queueing) -> first token sampled
    decode_s: float = 0.0
    store_s: float = 0.0
    total_s: float = 0.0

    def decode_tokens_per_s(self, completion_tokens: int) -> float:
        steps = completion_tokens - 1  # the first token comes from the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int
    timings: Timings
    hit_tiers: tuple[str, ...] = ()  # the tier each reused chunk came from
    stored_chunks: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class EngineStats:
    """Monotonic counters (read by the server's /metrics)."""

    requests: int = 0
    prompt_tokens: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_generated: int = 0
    chunks_stored: int = 0
    chunk_load_failures: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)


class Engine:
    """Generation over one model with an optional tiered KV store. One request at a time."""

    def __init__(
        self,
        model: LoadedModel,
        store: TieredStore | None = None,
        *,
        chunk_size: int = 256,
        kv_dtype: str = "float16",
        codec: str = "raw",
        codec_level: int = 0,
        store_generated: bool = False,
        salt: str = "",
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        self.model = model
        self.store = store
        self.chunk_size = chunk_size
        self.kv_dtype_name = kv_dtype
        self.kv_dtype = KV_DTYPES[kv_dtype]
        self.codec = get_codec(codec, codec_level)
        self.store_generated = store_generated
        self.base_salt = salt
        self.stats = EngineStats()
        self._lock = threading.Lock()
        c = model.config
        self._layout = layout_of(c.num_layers, c.num_kv_heads, c.head_dim)

    # ------------------------------------------------------------------------------ namespaces

    def namespace(self, tenant: str = "", salt: str = "") -> Namespace:
        """The cache namespace of this model/KV format for ``tenant``, inside request ``salt``."""
        full_salt = self.base_salt + ("\x00" + salt if salt else "")
        return Namespace(
            tenant=tenant,
            model_fingerprint=self.model.fingerprint,
            kv_dtype=self.kv_dtype_name,
            kv_layout=self._layout,
            codec=self.codec.name,
            codec_level=self.codec.level,
            salt=full_salt,
        )

    # ------------------------------------------------------------------------------ prompting

    def encode_prompt(self, prompt: str | Sequence[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids for a text prompt, a list of ids, or chat ``messages`` (rendered by the chat template)."""
        tok = self.model.tokenizer
        if messages is not None:
            return tok.encode_chat(messages)
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if prompt is None:
            raise ValueError("give a prompt or messages")
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids

    # ------------------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        *,
        cache: CacheOptions = CacheOptions(),
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> GenerationResult:
        """Generate from ``prompt_ids``; ``on_text`` receives text pieces as they are decoded.

        ``cancel`` is checked between steps (finish reason "cancelled"). Raises ValueError when
        the prompt is empty or prompt + max_tokens exceeds the model's context window.
        """
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        limit = self.model.config.max_position_embeddings
        if len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context window of {limit} tokens"
            )
        with self._lock:
            return self._generate(ids, params, cache, on_text, cancel)

    def _generate(self, ids, params, opts: CacheOptions, on_text, cancel) -> GenerationResult:
        t0 = time.perf_counter()
        timings = Timings()
        runner = self.model.runner
        kv = runner.new_cache(len(ids) + params.max_tokens, dtype=self.kv_dtype)
        use_store = self.store is not None and opts.enabled
        ns = self.namespace(opts.tenant, opts.salt) if use_store else None
        keys = [str(k) for k in prefix_keys(ids, self.chunk_size, ns)] if use_store else []

        hit_tiers: tuple[str, ...] = ()
        stored_upto = 0  # chunks [0, stored_upto) are known to be in the store
        if use_store:
            t = time.perf_counter()
            found = self.store.lookup(keys)
            timings.lookup_s = time.perf_counter() - t
            t = time.perf_counter()
            # At least one prompt token is always prefilled: its logits give the first token.
            load = min(found.hits, (len(ids) - 1) // self.chunk_size)
            hit_tiers = self._load_prefix(kv, keys[:load])
            stored_upto = found.hits if len(hit_tiers) == load else len(hit_tiers)
            timings.load_s = time.perf_counter() - t
        reused = kv.length

        if cancel is not None and cancel.is_set():  # e.g. the client left while the request was queued
            timings.total_s = time.perf_counter() - t0
            self._count(len(ids), reused, 0, 0, hit_tiers)
            return GenerationResult("", [], "cancelled", len(ids), reused, timings, hit_tiers)
        t = time.perf_counter()
        logits = runner.forward(ids[reused:], kv)
        timings.prefill_s = time.perf_counter() - t

        sampler = Sampler(params)
        token = sampler(logits)
        timings.ttft_s = time.perf_counter() - t0

        stored = 0
        if use_store:
            t = time.perf_counter()
            stored = self._store_chunks(kv, ids, keys, first=stored_upto)
            timings.store_s = time.perf_counter() - t

        out_ids, text, reason = self._decode(kv, token, params, sampler, on_text, cancel, timings)

        if use_store and (opts.store_generated if opts.store_generated is not None else self.store_generated):
            full = ids + out_ids[: kv.length - len(ids)]
            all_keys = [str(k) for k in prefix_keys(full, self.chunk_size, ns)]
            stored += self._store_chunks(kv, full, all_keys, first=len(keys))
        timings.total_s = time.perf_counter() - t0
        self._count(len(ids), reused, len(out_ids), stored, hit_tiers)
        return GenerationResult(text, out_ids, reason, len(ids), reused, timings, hit_tiers, stored)

    def _load_prefix(self, kv: KVCache, keys: list[str]) -> tuple[str, ...]:
        """Append the stored chunks for ``keys`` to ``kv``; stops at the first one that is missing,
        unreadable, or not what a prefix chunk at that place must be. Returns the tiers used."""
        if not keys:
            return ()
        used = []
        for i, (key, (blob, tier)) in enumerate(zip(keys, self.store.get_with_tiers(keys))):
            if blob is None:
                break
            try:
                chunk = decode_chunk(blob, expected_key=key, check_payload=False)
                start = i * self.chunk_size
                expected = torch.arange(start, start + self.chunk_size)
                if chunk.dtype != self.kv_dtype or not torch.equal(chunk.positions, expected):
                    raise FormatError("chunk dtype or positions do not match its prefix slot")
                kv.append_chunk(chunk)
            except (FormatError, ValueError) as e:
                log.warning("cached chunk %s is unusable (%s); treating it as a miss", key, e)
                self.stats.chunk_load_failures += 1
                break
            used.append(tier)
        return tuple(used)

    def _store_chunks(self, kv: KVCache, ids: list[int], keys: list[str], first: int) -> int:
        """Store the full chunks ``first..`` whose KV is in ``kv`` (memory now, lower tiers later)."""
        items = []
        for i in range(first, len(keys)):
            start, end = i * self.chunk_size, (i + 1) * self.chunk_size
            if end > kv.length:
                break
            items.append((keys[i], encode_entry(kv.chunk(start, end), keys[i], self.codec)))
        if items:
            self.store.put(items)
        return len(items)

    def _decode(self, kv, token, params, sampler, on_text, cancel, timings):
        tok = self.model.tokenizer
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model.eos_token_ids))
        decoder, stops = StreamDecoder(tok), StopMatcher(params.stop)
        out_ids: list[int] = []
        pieces: list[str] = []
        reason = "length"
        t = time.perf_counter()

        def emit(piece: str) -> None:
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        while True:
            if token in eos:
                reason = "stop"
                break
            out_ids.append(token)
            emit(stops.feed(decoder.push(token)))
            if stops.stopped:
                reason = "stop"
                break
            if len(out_ids) >= params.max_tokens:
                break
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            token = sampler(self.model.runner.forward([token], kv))
        if not stops.stopped:
            emit(stops.feed(decoder.flush()))
            emit(stops.flush())
        timings.decode_s = time.perf_counter() - t
        return out_ids, "".join(pieces), reason

    def _count(self, prompt: int, reused: int, generated: int, stored: int, tiers: tuple[str, ...]) -> None:
        s = self.stats
        s.requests += 1
        s.prompt_tokens += prompt
        s.tokens_reused += reused
        s.tokens_prefilled += prompt - reused
        s.tokens_generated += generated
        s.chunks_stored += stored
        for t in tiers:
            s.hits_by_tier[t] = s.hits_by_tier.get(t, 0) + 1
