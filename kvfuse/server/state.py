"""Everything one server app holds: configuration, engine, scheduler, authentication, metrics."""

from __future__ import annotations

import logging

from fastapi import Request

from kvfuse.config import Config

from .auth import Authenticator
from .metrics import ServerMetrics
from .scheduler import Scheduler
from .translate import Limits

log = logging.getLogger(__name__)


class ServerState:
    """The parts of a running app. ``start()`` opens the engine (unless one was given) and starts the
    worker; ``stop()`` cancels what is left and flushes the store's pending lower-tier writes."""

    def __init__(self, config: Config, engine=None):
        self.config = config
        self.engine = engine
        self.owns_engine = engine is None
        self.auth = Authenticator(config.api_key_map())
        self.scheduler: Scheduler | None = None
        self.metrics = ServerMetrics(
            lambda: self.engine,
            waiting=lambda: len(self.scheduler.queue) if self.scheduler else 0,
            running=lambda: int(self.scheduler is not None and self.scheduler.running is not None),
        )

    def start(self) -> None:
        if self.engine is None:
            from kvfuse.runtime import open_engine

            self.engine = open_engine(self.config)
        self.scheduler = Scheduler(self.engine, self.config.server.max_queue)
        self.scheduler.start()

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        store = self.engine.store if self.engine is not None else None
        if store is not None:
            if self.owns_engine:
                store.close()  # flushes the queued writes first
            elif not store.flush(timeout=60):
                log.warning("the store's pending writes did not finish within 60 s")

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    @property
    def limits(self) -> Limits:
        s = self.config.server
        return Limits(s.max_tokens_limit, s.default_max_tokens, self.engine.model.config.max_position_embeddings)


def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the state of the app serving ``request``."""
    return request.app.state.kvfuse
