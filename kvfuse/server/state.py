"""Everything one server app holds: configuration, engine, authentication, metrics.

The server does not schedule anything itself: requests go to the engine's queue
(``Engine.submit``), which runs them on its own loop thread; statistics and tenant clearing go
through the engine's narrow API (``stats_snapshot``, ``cache_stats``, ``queue_state``,
``clear_cache``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvfuse.config import Config
from kvfuse.config.secrets import read_secret
from kvfuse.config.signing import signer_of
from kvfuse.config.tenants import EVERY, quota_of
from kvfuse.history.response_store import ResponseStore, StoreLimits
from kvfuse.kv.keys import tenant_tag
from kvfuse.kv.signing import EntrySigner
from kvfuse.runtime import Serving

from .auth import ANONYMOUS, Authenticator, MetricsToken
from .logprobs import TokenTexts
from .maintenance import MaintenancePool
from .metrics import ServerMetrics
from .rate_limit import RateLimiter, rate_limited
from .structured import Grammars
from .translate import Limits, Prompting
from .vllm_metrics import EventsCollector

log = logging.getLogger(__name__)


class ServerState:
    """The parts of a running app. ``start()`` opens the engine (unless one was given) and starts its
    loop; ``stop()`` cancels what is left and flushes the store's pending lower-tier writes (and
    closes an engine it opened)."""

    def __init__(
        self,
        config: Config,
        serving: Serving | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.config = config
        # What /health answers: starting (503) until start() has run, serving (200), draining
        # (503) from a stop signal or stop() on, so routers stop sending before requests fail.
        self.phase = "starting"
        self.owns_engine = serving is None
        self.engine = serving.engine if serving is not None else None
        self.prompting = self._prompting(serving) if serving is not None else None
        self.clock = clock or time.time  # stored responses expire by it (tests inject one)
        self.auth = Authenticator(config.api_key_map())
        s = config.server
        self.metrics_token = MetricsToken(
            s.metrics_token or read_secret("server.metrics_token_file", path=s.metrics_token_file)
        )
        names = {tenant_tag(name): name for name in self.auth.tenants | {ANONYMOUS}}
        self.metrics = ServerMetrics(
            lambda: self.engine,
            tenant_names=names,
            queue=lambda: self.engine.queue_state() if self.engine else {},
        )
        self.limiter = RateLimiter(self._requests_per_minute)
        # deletes, scans, stats, stored responses: threads of their own, bounded (maintenance.py)
        self.maintenance = MaintenancePool(
            s.maintenance_workers,
            s.maintenance_queue,
            s.maintenance_per_tenant,
            s.maintenance_timeout_s,
        )
        self.events = None  # the KV event publisher (server.kv_events), once started
        self.metrics.registry.register(EventsCollector(lambda: self.events))
        self.responses: ResponseStore | None = None  # the Responses API's stored responses (SQLite)
        self.record_signer: EntrySigner | None = None  # signs the stored responses' records
        self._token_texts: TokenTexts | None = None
        self.response_limits = StoreLimits()
        self.metrics.stored_responses.set_function(
            lambda: len(self.responses) if self.responses is not None else 0
        )

    def _prompting(self, serving: Serving) -> Prompting:
        c = self.config
        grammars = Grammars(serving.engine.model, c.server.grammar_cache_size)
        return Prompting(serving.prompts, c.blend.auto_reuse, grammars)

    def _requests_per_minute(self, tenant: str) -> int | None:
        quota = quota_of(self.config.tenants, tenant)
        return quota.requests_per_minute if quota is not None else None

    def admit(self, tenant: str) -> None:
        """Count a request of ``tenant`` (any authenticated route) against its rate limit; the 429
        (counted in the metrics) when it is over it."""
        got = self.limiter.admit(tenant)
        if got is None or got[0].allowed:
            return
        decision, limit = got
        section = quota_of(self.config.tenants, tenant).tenant
        setting = (
            f"tenants.{section if section != EVERY else repr(EVERY)}.quota.requests_per_minute"
        )
        self.metrics.quota_rejections.labels(tenant=tenant, limit="requests_per_minute").inc()
        raise rate_limited(tenant, setting, decision, limit)

    def start(self) -> None:
        if not self.auth.enabled:
            log.warning(
                "serving without API keys (server.api_keys): every client is one tenant and "
                "shares its cache namespace; usage reports cached tokens in whole chunks unless a "
                "request names its conversation (prompt_cache_key, previous_response_id, user)"
                if self.config.server.cached_tokens == "chunk"
                else "serving without API keys (server.api_keys) and with exact cached_tokens: "
                "any client can learn what others' prompts share with its own, token by token"
            )
        if self.engine is None:
            from kvfuse.runtime import open_serving

            serving = open_serving(self.config, clock=self.clock)
            self.engine = serving.engine
            self.prompting = self._prompting(serving)
        r = self.config.responses
        if r.store:
            # the history records stored with responses are signed like entries (records.py)
            self.record_signer = signer_of(self.config.cache)
            self.responses = ResponseStore(self.config.responses_path, r.ttl_s, clock=self.clock)
            self.response_limits = StoreLimits(
                r.max_response_bytes, r.tenant_max_responses, r.tenant_max_bytes
            )
            _, keys = self.responses.purge()  # what expired while the server was down
            self.engine.free_entries(keys)
        if self.config.server.kv_events is not None:
            from kvfuse.events.hub import open_kv_events

            self.events = open_kv_events(self.config.server, self.engine)
        self.engine.start()
        if self.phase == "starting":
            self.phase = "serving"

    def drain(self) -> None:
        """A stop is coming (SIGTERM): /health turns 503 while the requests in flight finish."""
        self.phase = "draining"

    def stop(self) -> None:
        """Stop in dependency order: the engine's loop first (a request still running may store its
        response), the saves and lower-tier writes flushed within ``FLUSH_DEADLINE_S``, and only
        then the saver and the store closed (an owned engine), the events and the Responses
        store (``shutdown_order``)."""
        self.drain()
        self.maintenance.close()
        for step in shutdown_order(self.engine is not None, self.owns_engine):
            getattr(self, f"_stop_{step}")()

    def _stop_engine(self) -> None:
        self.engine.stop()

    def _stop_flush(self) -> None:
        if not self.engine.flush(timeout=FLUSH_DEADLINE_S):
            log.warning("the store's pending writes did not finish within %.0f s", FLUSH_DEADLINE_S)

    def _stop_close(self) -> None:
        # the flush deadline has been honoured: closing waits a moment more, not a deadline again
        self.engine.close(flush_timeout=CLOSE_GRACE_S)

    def _stop_events(self) -> None:
        self._close_events()

    def _stop_responses(self) -> None:
        if self.responses is not None:
            self.responses.close()
            self.responses = None

    def _close_events(self) -> None:
        """After the last writes: unhook the publisher, send what it holds, close its sockets."""
        if self.events is not None:
            from kvfuse.events.hub import detach

            detach(self.events, self.engine)
            self.events.close()
            self.events = None

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    @property
    def limits(self) -> Limits:
        s = self.config.server
        return Limits(
            s.max_tokens_limit,
            s.default_max_tokens,
            self.engine.context_window,
            self.engine.model.config.vocab_size,
        )

    @property
    def token_texts(self) -> TokenTexts:
        """Each token's text and bytes, as logprobs report them (built once)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.model.tokenizer)
        return self._token_texts


# How long a stopping server waits for the saves and lower-tier writes still queued.
FLUSH_DEADLINE_S = 60.0
# How long closing the saver and the store may take after that (their threads' joins).
CLOSE_GRACE_S = 5.0


def shutdown_order(has_engine: bool, owns_engine: bool) -> list[str]:
    """The steps of ``ServerState.stop``, in order: the engine's loop stops before anything it
    uses is closed (requests still running write stored responses and KV), the store's flush
    deadline is honoured before the saver and the store are closed (an engine the server
    opened; a given one is its owner's to close), the KV events after the last writes, and the
    Responses store last."""
    if not has_engine:
        return ["responses"]
    return ["engine", "flush", *(["close"] if owns_engine else []), "events", "responses"]
