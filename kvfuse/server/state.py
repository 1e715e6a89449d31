"""Everything one server app holds: configuration, engine, authentication, metrics.

The server does not schedule anything itself: requests go to the engine's queue
(``Engine.submit``), which runs them on its own loop thread; statistics and tenant clearing go
through the engine's narrow API (``stats_snapshot``, ``cache_stats``, ``queue_state``,
``clear_cache``).
"""

from __future__ import annotations

import logging

from kvfuse.config import Config

from .auth import Authenticator
from .metrics import ServerMetrics
from .translate import Limits

log = logging.getLogger(__name__)


class ServerState:
    """The parts of a running app. ``start()`` opens the engine (unless one was given) and starts its
    loop; ``stop()`` cancels what is left and flushes the store's pending lower-tier writes (and
    closes an engine it opened)."""

    def __init__(self, config: Config, engine=None):
        self.config = config
        self.engine = engine
        self.owns_engine = engine is None
        self.auth = Authenticator(config.api_key_map())
        self.metrics = ServerMetrics(lambda: self.engine, queue=lambda: self.engine.queue_state() if self.engine else {})

    def start(self) -> None:
        if self.engine is None:
            from kvfuse.runtime import open_engine

            self.engine = open_engine(self.config)
        self.engine.start()

    def stop(self) -> None:
        if self.engine is None:
            return
        if self.owns_engine:
            self.engine.close()  # stops the loop, flushes the queued writes, closes the store
            return
        self.engine.stop()
        if not self.engine.flush(timeout=60):
            log.warning("the store's pending writes did not finish within 60 s")

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    @property
    def limits(self) -> Limits:
        s = self.config.server
        return Limits(s.max_tokens_limit, s.default_max_tokens, self.engine.context_window)
