"""The configuration's sections and their defaults: the only place kvfuse's defaults are written.

Every section is a frozen dataclass; ``Config`` holds them all. ``load.load_config`` fills them
from a file, the environment and flags, and ``validate.validate`` checks them. ``EngineSettings``
is what an engine reads of a ``Config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvfuse import dtypes
from kvfuse.durations import parse_duration

from .api_keys import split_entry
from .errors import ConfigError as ConfigError  # re-exported: where the other modules import it
from .tenants import TenantQuota

KV_DTYPES = dtypes.KV_DTYPES
WEIGHT_FORMATS = (
    "auto",
    "fp32",
    "int8",
)  # = models.quant.WEIGHT_FORMATS (a unit test keeps them equal)
# kvfuse's CPU kernels (models.cpu.backend): auto = where they build, on = required, off = PyTorch
KERNEL_MODES = ("auto", "on", "off")
METHODS = (
    "hkvd",
    "hkvd-head",
    "sinks",
    "sinks+hkvd",
    "attn",
    "hkvd-attn",
    "prefix",
)  # blend token selection
# what decided a blend's budget (``guard``: the online guard turned blending off for now)
BUDGET_SOURCES = ("config", "request", "profile", "default", "guard")
QUERY_AWARE = ("attn", "hkvd-attn")  # selections that look at the suffix: their blend depends on it
DEVIATIONS = ("k", "v")
CONTEXTS = ("bos", "none", "prefix", "eos")
AUTO_MODES = ("off", "on")  # blend.auto: automatic reuse of cached passages inside plain prompts
TIER_KINDS = ("disk", "redis", "s3")


@dataclass(frozen=True)
class TierConfig:
    """One tier below memory: an entry of ``cache.tiers``, asked in list order (disk, then Redis,
    then S3 is the usual order: fastest first). Fields per kind:

    - ``disk``: ``path`` (default ``<home>/kv``), ``capacity_bytes`` (default ``cache.disk_bytes``'s);
    - ``redis``: ``url`` (``redis://``, ``rediss://``, ``unix://``), ``timeout_s``, ``cluster``,
      ``username``, ``password_env`` or ``password_file`` (where the password is), ``tls_ca_file``,
      ``tls_cert_file`` and ``tls_key_file`` (TLS: a ``rediss://`` URL);
    - ``s3``: ``url`` (``s3://BUCKET[/PREFIX]``), ``endpoint``, ``region``, ``timeout_s``, ``sse``
      (``AES256`` or ``aws:kms``) and ``sse_kms_key_id``;
    - all: ``name`` (default: the kind; unique), ``codec`` and ``codec_level`` (the encoding the
      tier writes; none: as the memory tier holds it).

    A field left out takes the default of the flat key it stands for (``cache.redis_timeout_s``...)."""

    kind: str
    name: str = ""
    path: str | None = None
    capacity_bytes: int | None = None
    url: str | None = None
    timeout_s: float | None = None
    cluster: bool = False
    endpoint: str | None = None
    region: str | None = None
    codec: str | None = None
    codec_level: int = 0
    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    sse: str | None = None
    sse_kms_key_id: str | None = None

    REDIS_SECURITY = (
        "username",
        "password_env",
        "password_file",
        "tls_ca_file",
        "tls_cert_file",
        "tls_key_file",
    )
    KIND_FIELDS = {
        "disk": ("path", "capacity_bytes"),
        "redis": ("url", "timeout_s", "cluster", *REDIS_SECURITY),
        "s3": ("url", "endpoint", "region", "timeout_s", "sse", "sse_kms_key_id"),
    }
    COMMON = ("kind", "name", "codec", "codec_level")

    @property
    def tier_name(self) -> str:
        return self.name or self.kind

    @property
    def timeout(self) -> float:
        """The tier's time-out: its own, or the default of its kind's flat key."""
        if self.timeout_s is not None:
            return self.timeout_s
        return CacheConfig.redis_timeout_s if self.kind == "redis" else CacheConfig.s3_timeout_s

    @property
    def capacity(self) -> int:
        """A disk tier's capacity: its own, or ``cache.disk_bytes``'s default."""
        return self.capacity_bytes if self.capacity_bytes is not None else CacheConfig.disk_bytes


@dataclass(frozen=True)
class CacheConfig:
    """The KV store: chunking, encoding, and the tiers. The tiers below memory are either a list of
    sections (``tiers``, see ``TierConfig``) or, as in earlier versions and still supported, the
    flat keys ``disk*``, ``redis_*`` and ``s3_*`` (one tier of each kind at most); not both."""

    enabled: bool = True
    chunk_size: int = 256
    kv_dtype: str = "float16"
    codec: str = "raw"
    codec_level: int = 0  # 0: the model's calibrated level (kvfuse calibrate), else the codec's default (cachegen: 2)
    memory_bytes: int = 2 * 1024**3
    disk: bool = True
    disk_path: str | None = None  # default: <home>/kv
    disk_bytes: int = 20 * 1024**3
    redis_url: str | None = None
    redis_timeout_s: float = 0.5
    redis_cluster: bool = False  # redis_url is a node of a Redis / Valkey cluster
    # Redis ACL and TLS (rediss:// URLs): the user, where its password is (a variable or a file,
    # never the password itself: config/secrets.py), the CA that signed the server's certificate,
    # and a client certificate and key when the server asks for one (tls-auth-clients).
    redis_username: str | None = None
    redis_password_env: str | None = None
    redis_password_file: str | None = None
    redis_tls_ca_file: str | None = None
    redis_tls_cert_file: str | None = None
    redis_tls_key_file: str | None = None
    # The S3 tier (cold, after disk and Redis): s3://bucket/prefix, an endpoint for S3-compatible
    # stores (MinIO, Ceph, moto; none = AWS), credentials from boto3's usual chain.
    s3_url: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_timeout_s: float = 2.0
    s3_codec: str | None = None
    s3_codec_level: int = 0
    # Server-side encryption of every object the S3 tier writes: AES256 (S3-managed keys) or aws:kms
    # (with s3_sse_kms_key_id, or the account's default KMS key); none: the bucket's default.
    s3_sse: str | None = None
    s3_sse_kms_key_id: str | None = None
    write_queue: int = 64
    save_queue: int = 16  # saves waiting for the saver (each holds a sequence's KV); more: skipped
    store_generated: bool = False  # without history: store the answers' whole chunks too
    salt: str = ""
    history: bool = (
        True  # whole-history reuse: a turn's prompt and answer KV kept for the next turn
    )
    history_records: int = (
        2048  # stored histories whose ids are remembered (to line up later turns)
    )
    truncation: str = "reuse"  # a conversation beyond the context window: reuse | recompute | off
    async_save: bool = True  # save new KV on a thread of its own, off the request path
    prefetch: bool = True  # read queued requests' KV from disk / Redis into memory before they run
    eviction: str = "queue"  # memory tier: queue (keep queued requests' entries) | lru
    # Per-tier codecs: the memory tier writes ``codec``; disk and Redis write their own when set
    # (e.g. cachegen), else the same. Readers accept any codec, whatever wrote an entry.
    disk_codec: str | None = None
    disk_codec_level: int = 0
    redis_codec: str | None = None
    redis_codec_level: int = 0
    stream_levels: tuple[
        int, ...
    ] = ()  # extra CacheGen levels written to disk / Redis for streaming
    kv_slo_ms: float | None = None  # load slow-tier KV adaptively within this budget (None: off)
    codec_workers: int | None = None  # processes that encode / decode CacheGen (None: one per core)
    # How long the entries a request writes stay when it does not say (prompt_cache_retention):
    # none = the tiers' policy (every tier, until evicted), in_memory, or a duration such as 24h.
    retention: str | None = None
    tiers: tuple[TierConfig, ...] | None = (
        None  # the tiers below memory, in order (None: the flat keys)
    )
    # Signed entries (config/signing.py, docs/deploy.md): with keys, every entry written to disk,
    # Redis or S3 carries an HMAC-SHA256 and every entry read back must carry one an accepted key
    # made. Give them one way: one key, a list (the first signs, every one is accepted: rotation),
    # or a file of one key per line (the first signs). Secrets: left out of reprs and error messages.
    signing_key: str | None = field(default=None, repr=False)
    signing_keys: tuple[str, ...] = field(default=(), repr=False)
    signing_key_file: str | None = None
    # Encrypted entries (config/encryption.py, docs/deploy.md): a file of AES-256 keys, 64 hex
    # digits a line (the first encrypts, all decrypt); every entry written to disk, Redis or S3 is
    # then sealed with AES-GCM (token ids and KV), every one read back opened (None: off).
    encryption_key_file: str | None = None

    def flat_tiers(self) -> tuple[TierConfig, ...]:
        """The tiers the flat keys describe: disk (unless ``disk: false``), Redis and S3 when their
        URLs are set, in that order."""
        out = []
        if self.disk:
            out.append(
                TierConfig(
                    "disk",
                    path=self.disk_path,
                    capacity_bytes=self.disk_bytes,
                    codec=self.disk_codec,
                    codec_level=self.disk_codec_level,
                )
            )
        if self.redis_url:
            out.append(
                TierConfig(
                    "redis",
                    url=self.redis_url,
                    timeout_s=self.redis_timeout_s,
                    cluster=self.redis_cluster,
                    codec=self.redis_codec,
                    codec_level=self.redis_codec_level,
                    **{f: getattr(self, f"redis_{f}") for f in TierConfig.REDIS_SECURITY},
                )
            )
        if self.s3_url:
            out.append(
                TierConfig(
                    "s3",
                    url=self.s3_url,
                    endpoint=self.s3_endpoint,
                    region=self.s3_region,
                    timeout_s=self.s3_timeout_s,
                    codec=self.s3_codec,
                    codec_level=self.s3_codec_level,
                    sse=self.s3_sse,
                    sse_kms_key_id=self.s3_sse_kms_key_id,
                )
            )
        return tuple(out)


@dataclass(frozen=True)
class BlendOptions:
    """The ``blend:`` section, and a request's blend (the server's ``recompute_ratio`` overrides
    the ratio): one frozen value, checked when it is made (a request's override too).

    ``recompute_ratio``: the fraction of document tokens recomputed in context (0 = full reuse:
    the documents' KV concatenated as stored; 1 = every token recomputed, a full prefill), or
    ``auto`` (the default): the method and budget the model's calibrated profile found to keep its
    answers (``kvfuse calibrate``; ``kvfuse.config.profiles``), a conservative budget for a
    model without one. The engine resolves ``auto`` when it starts; ``source`` says what decided
    the budget (config, request, profile, default).

    - ``method``: how tokens are chosen. ``hkvd``: the largest deviation between fresh and cached
      K or V at the check layer (CacheBlend); ``hkvd-head``: the same, scored by the head that
      deviates most (each head's deviations scaled to its mean); ``sinks``: the first tokens of
      every document (EPIC); ``sinks+hkvd``: the first ``sink_tokens`` of every document, the rest
      of the budget by deviation; ``attn``: the document tokens the suffix (the question) attends
      to most at the check layer; ``hkvd-attn``: deviation times that attention. The last two
      depend on the question, so their blended prompt is stored under keys of the whole prompt.
      ``prefix``: no blending: the documents are part of the prompt, reused only as an exact
      prefix (what ``auto`` picks for a model whose calibration found no budget that pays off).
    - ``check_layer``: the layer whose deviation ranks tokens; layers before it ("full" layers)
      are computed for every document token, later ones only for the selected tokens.
    - ``deviation``: compare K or V.
    - ``gradual``: select twice the budget at the check layer and shrink to the budget over the
      next three layers, each time by that layer's deviation (the paper's gradual filtering).
    - ``document_context``: what a document's KV is computed behind when it is cached on its own:
      ``bos`` (the model's BOS token, dropped from the entry), ``eos`` (its end-of-text token),
      ``prefix`` (the prompt's own tokens before the first document, e.g. the system prompt and
      chat header: a document's entry is then reused only behind the same prefix) or ``none``.
    - ``store_blended``: store a blended prompt's KV as prefix chunks (in the blend namespace), so
      a repeated prompt with the same documents is an exact prefix hit.
    - ``auto``: automatic reuse (``on`` | ``off``, the default): plain prompts (no ``documents``, no
      cache breakpoints) are also cut into content-defined chunks; chunks a tier holds from
      another prompt, at another position, are loaded and blended with this section's method
      and budget (none when the model's blend is ``prefix``); a request's ``blend_auto`` overrides
      it. Not part of the identity: it changes which prompts blend, not how.
    - ``auto_min_tokens``: prompts at least this long store their content chunks (shorter ones
      only look them up): what bounds the extra storage.
    - ``verify_rate`` (0: off): the online guard (``kvfuse.reuse.guard``): the share of blended
      requests checked, when the engine is idle, against a full prefill of the same prompt;
      ``verify_tokens`` answer tokens compared; over the last ``verify_window`` checks (at least
      ``verify_min``), an agreement below ``verify_target`` turns blending off (exact prefix
      reuse) until it recovers. Not part of the identity.
    """

    recompute_ratio: float | str = "auto"
    method: str = "hkvd"
    check_layer: int = 1
    deviation: str = "v"
    gradual: bool = False
    sink_tokens: int = 4
    document_context: str = "bos"
    store_blended: bool = True
    auto: str = "off"  # automatic reuse of passages found in plain prompts (AUTO_MODES)
    auto_min_tokens: int = 1024  # prompts at least this long store their content chunks
    verify_rate: float = 0.0  # share of blended requests the online guard checks (0: off)
    verify_tokens: int = 8  # answer tokens a check compares
    verify_target: float = 0.9  # agreement with full prefill below which blending turns off
    verify_window: int = 50  # the last checks the agreement is taken over
    verify_min: int = 10  # checks needed before the guard decides anything
    source: str = "config"  # what decided the budget (BUDGET_SOURCES); not part of the identity

    def __post_init__(self) -> None:
        r = self.recompute_ratio
        if r != "auto":
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
                raise ValueError(f'recompute_ratio must be a number in [0, 1] or "auto", got {r!r}')
            object.__setattr__(self, "recompute_ratio", float(r))
        if self.source not in BUDGET_SOURCES:
            raise ValueError(
                f"blend source must be one of {', '.join(BUDGET_SOURCES)}, got {self.source!r}"
            )
        if self.method not in METHODS:
            raise ValueError(
                f"blend method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if self.deviation not in DEVIATIONS:
            raise ValueError(f"blend deviation must be 'k' or 'v', got {self.deviation!r}")
        if self.auto not in AUTO_MODES:
            raise ValueError(
                f"blend.auto must be one of {', '.join(AUTO_MODES)}, got {self.auto!r}"
            )
        if self.document_context not in CONTEXTS:
            raise ValueError(
                f"document_context must be one of {', '.join(CONTEXTS)}, got {self.document_context!r}"
            )
        for name in ("check_layer", "sink_tokens", "auto_min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self._check_guard()

    def _check_guard(self) -> None:
        for name in ("verify_rate", "verify_target"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"blend.{name} must be a number in [0, 1], got {v!r}")
        for name in ("verify_tokens", "verify_window", "verify_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"blend.{name} must be an integer >= 1, got {v!r}")
        if self.verify_min > self.verify_window:
            raise ValueError(
                f"blend.verify_min ({self.verify_min}) must be at most blend.verify_window "
                f"({self.verify_window})"
            )

    def with_ratio(self, ratio: float | str | None) -> BlendOptions:
        """These options with a request's recompute ratio (None: unchanged; ``auto``: to be
        resolved by the engine from the model's profile)."""
        if ratio is None:
            return self
        if ratio == "auto":
            return replace(self, recompute_ratio="auto", source="config")
        method = "hkvd" if self.method == "prefix" else self.method  # a budget asks for a blend
        return replace(self, recompute_ratio=ratio, method=method, source="request")

    @property
    def auto_budget(self) -> bool:
        """The budget is the model's calibrated one (``kvfuse.config.profiles.resolve``)."""
        return self.recompute_ratio == "auto"

    @property
    def auto_reuse(self) -> bool:
        """Plain prompts look for cached passages unless a request says otherwise (``blend.auto: on``)."""
        return self.auto == "on"

    @property
    def blends(self) -> bool:
        """Documents are blended (``prefix``: reused only as an exact prompt prefix, no blending)."""
        return self.method != "prefix"

    @property
    def query_aware(self) -> bool:
        return self.method in QUERY_AWARE and not self.full_reuse

    @property
    def full_reuse(self) -> bool:
        return self.recompute_ratio == 0.0

    def identity(self) -> str:
        """Everything that changes the blended KV, as a namespace salt."""
        if self.auto_budget:
            raise ValueError(
                "recompute_ratio auto has no identity: resolve it against the model's profile first"
            )
        if self.full_reuse:
            return f"blend:reuse:{self.document_context}"
        return (
            f"blend:{self.method}:{self.recompute_ratio:g}:L{self.check_layer}:{self.deviation}:"
            f"{'gradual' if self.gradual else 'once'}:{self.sink_tokens}:{self.document_context}"
        )


@dataclass(frozen=True)
class EngineConfig:
    """Continuous batching: how many sequences share a step, and the live KV they may hold."""

    max_running: int = 32  # sequences decoded / prefilled together in one step
    max_step_tokens: int = 256  # tokens per forward pass: decodes first, then prompt chunks
    # prompt tokens per forward pass while no sequence decodes (None: max_step_tokens): nobody
    # waits on such a step for a token, and a prompt computed in fewer, longer passes is faster
    # (docs/benchmarks.md "Cold prompts")
    max_prefill_tokens: int | None = 2048
    kv_memory_bytes: int | None = (
        4 * 1024**3
    )  # live KV of all running sequences together (None: unbounded)
    # seconds of idleness after which the heap's freed buffers go back to the kernel (kvfuse.heap;
    # None: kept, the resident size stays at its peak)
    release_idle_s: float | None = 5.0


@dataclass(frozen=True)
class ResponsesConfig:
    """Stored responses of the Responses API (what ``previous_response_id`` names)."""

    store: bool = True  # keep responses whose request says store: true (false: keep none)
    path: str | None = None  # the SQLite file; default: <home>/responses.sqlite3
    ttl: str = "30d"  # a stored response expires this long after it was created
    # what one stored response may take (body, history, input items, record; None: no limit),
    # and what each tenant may keep: responses and bytes (beyond any of them: a 413)
    max_response_bytes: int | None = 8 * 1024**2
    tenant_max_responses: int | None = 100_000
    tenant_max_bytes: int | None = 1024**3

    @property
    def ttl_s(self) -> float:
        return parse_duration(self.ttl)


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000
    # "KEY:TENANT" or "sha256:<hex>:TENANT" entries (kvfuse keys digest); empty = no authentication
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_queue: int = 64
    max_body_bytes: int = 4 * 1024**2
    # a chat's messages and characters (every string in them), refused beyond (a 400) before
    # anything is rendered: rendering and tokenizing cost grows with them
    max_chat_messages: int = 4096
    max_chat_chars: int = 4 * 1024**2
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    # compiled structured-output grammars kept (JSON schemas, per the served model; 0: none)
    grammar_cache_size: int = 128
    # a non-streaming request not answered within this many seconds of its arrival is withdrawn
    # and answered 504 (0: no deadline); a stream's client decides when to leave
    request_timeout_s: float = 600.0
    # /health answers 503 (wedged) when work waits and no engine step did anything for this long
    stall_after_s: float = 60.0
    # wrong or missing API keys allowed per client address and minute (then 429; 0: no limit)
    auth_failures_per_minute: int = 60
    # connections and requests handled at once (uvicorn's limit_concurrency; beyond: 503; 0: none)
    limit_concurrency: int = 1024
    # a request body not received this long after its first read: 408 (0: no limit)
    body_timeout_s: float = 30.0
    # maintenance (DELETE /v1/kv, /v1/kv/stats, stored responses) runs on this many threads of its
    # own, never the generation requests' (kvfuse/server/maintenance.py)
    maintenance_workers: int = 2
    # maintenance jobs waiting or running at once (beyond: 503), and per tenant (beyond: 429)
    maintenance_queue: int = 8
    maintenance_per_tenant: int = 2
    # a maintenance request waits this long for its job (then 504; the job finishes by itself);
    # DELETE /v1/kv waits at most half of it for the saves queued before it (then 202)
    maintenance_timeout_s: float = 10.0
    # usage's cached_tokens: "chunk" (rounded down to whole chunks unless the request names its
    # conversation: prompt_cache_key, previous_response_id, user) or "exact" (server.disclosure)
    cached_tokens: str = "chunk"
    # /metrics behind a bearer token (TOKEN or sha256:<hex>; KVFUSE_SERVER_METRICS_TOKEN), or the
    # token read from a file (e.g. a mounted secret); neither: /metrics is open, like /health.
    metrics_token: str | None = field(default=None, repr=False)
    metrics_token_file: str | None = None
    # What GET /v1/models answers in owned_by: "vllm" lets routers that detect a worker's runtime
    # from it (SMG, llm-d) treat kvfuse as a vLLM-type worker (docs/routers.md).
    owned_by: str = "vllm"
    # KV events in vLLM's format for cache-aware routers (kvfuse/events/): the ZMQ endpoint bound
    # for them (``tcp://HOST:PORT``, ``ipc://PATH``; None: off), an optional replay endpoint, the
    # topic, the tokens per announced block (must divide cache.chunk_size; the router's
    # --kv-event-block-size), the bounded hand-off queue (full: events dropped and counted), the
    # batches kept for replay and the most chunks remembered for their removal events.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    kv_events_block_size: int = 16
    kv_events_queue: int = 10_000
    kv_events_buffer: int = 10_000
    kv_events_chunks: int = 16_384


@dataclass(frozen=True)
class Config:
    """Everything kvfuse reads. Build it with ``load_config``; it never changes afterwards."""

    home: str = ""  # "" -> ~/.cache/kvfuse
    model: str = "smollm2"
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # auto (GGUF blocks on CPU) | fp32 (dequantized) | int8 (CPU; own KV)
    kernels: str = "auto"  # kvfuse's CPU kernels: auto (where they build) | on (required) | off
    threads: int = 0  # 0 = all cores
    context_tokens: int = (
        0  # the context window; 0 = the model's (lower it to truncate conversations sooner)
    )
    tune_malloc: bool = True  # keep freed multi-MB buffers for reuse while busy (kvfuse.heap)
    log_level: str = "info"
    cache: CacheConfig = field(default_factory=CacheConfig)
    blend: BlendOptions = field(default_factory=BlendOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    tenants: tuple[TenantQuota, ...] = ()  # per-tenant quotas (config/tenants.py); () = none

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser() if self.home else Path.home() / ".cache" / "kvfuse"

    def lower_tiers(self) -> tuple[TierConfig, ...]:
        """The tiers below memory, in order (``cache.tiers``, or the flat keys), disk paths resolved."""
        tiers = self.cache.tiers if self.cache.tiers is not None else self.cache.flat_tiers()
        return tuple(
            replace(t, path=str(self._path_or(t.path, "kv"))) if t.kind == "disk" else t
            for t in tiers
        )

    @property
    def disk_path(self) -> Path | None:
        """The first disk tier's folder (where the records of stored histories live too), or None."""
        disk = next((t for t in self.lower_tiers() if t.kind == "disk"), None)
        return Path(disk.path) if disk is not None else None

    def _path_or(self, path: str | None, default: str) -> Path:
        return Path(path).expanduser() if path else self.home_path / default

    @property
    def responses_path(self) -> Path:
        return self._path_or(self.responses.path, "responses.sqlite3")

    def engine_settings(self) -> EngineSettings:
        """The settings an engine runs with (see ``EngineSettings``); the records of stored
        histories live next to their KV on the disk tier, and survive restarts with it."""
        return EngineSettings(
            cache=self.cache,
            blend=self.blend,
            engine=self.engine,
            context_tokens=self.context_tokens,
            max_queue=self.server.max_queue,
            history_path=str(self.disk_path / "histories") if self.disk_path is not None else None,
            profiles_path=str(self.home_path / "profiles"),
        )

    def api_key_map(self) -> dict[str, str]:
        """Key (or ``sha256:<hex>`` digest) -> tenant, from ``server.api_keys``."""
        return dict(split_entry(entry) for entry in self.server.api_keys)


@dataclass(frozen=True)
class EngineSettings:
    """What the engine reads, in one object: the cache, blend and engine sections, the context
    window, the queue bound and where the records of stored histories are kept.

    ``Config.engine_settings()`` builds it from a validated configuration, and the engine takes it
    as it is (it checks only what depends on the model, such as the blend's check layer).
    ``EngineSettings.of(chunk_size=16, history=False, ...)`` builds one from the sections' field
    names (tests, benchmarks); unset fields keep the defaults above, the only ones there are."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    blend: BlendOptions = field(default_factory=BlendOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    context_tokens: int = 0  # as Config.context_tokens: 0 = the model's context window
    max_queue: int = ServerConfig.max_queue
    history_path: str | None = (
        None  # a folder for the records of stored histories (None: memory only)
    )
    profiles_path: str | None = (
        None  # the user's blend profiles (kvfuse calibrate); None: shipped ones only
    )

    @classmethod
    def of(cls, blend: BlendOptions | None = None, **fields: Any) -> EngineSettings:
        """Settings from field names of ``CacheConfig`` and ``EngineConfig`` (and this class's
        own: ``context_tokens``, ``max_queue``, ``history_path``, ``profiles_path``); ``blend``: the
        blend options.
        A name that is no such field is a TypeError."""
        sections: dict[str, dict[str, Any]] = {"cache": {}, "engine": {}}
        own: dict[str, Any] = {}
        for name, value in fields.items():
            if name in ("context_tokens", "max_queue", "history_path", "profiles_path"):
                own[name] = value
            elif name in FIELDS["cache"]:
                sections["cache"][name] = value
            elif name in FIELDS["engine"]:
                sections["engine"][name] = value
            else:
                raise TypeError(f"unknown engine setting {name!r}")
        return cls(
            cache=CacheConfig(**sections["cache"]),
            engine=EngineConfig(**sections["engine"]),
            blend=blend if blend is not None else BlendOptions(),
            **own,
        )


SECTIONS = {
    "cache": CacheConfig,
    "blend": BlendOptions,
    "engine": EngineConfig,
    "responses": ResponsesConfig,
    "server": ServerConfig,
}
FIELDS = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
