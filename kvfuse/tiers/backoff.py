"""Back-off for a remote tier (Redis, S3) while its server is away.

A failure (refused, reset, timed out) is logged once, counted as an error of the tier, and starts
a back-off of ``backoff_s`` during which the tier answers misses at once (writes dropped and
counted) without touching the network. The first call after the back-off tries the server again;
its first success logs the recovery.

A seam of its own because both remote tiers need exactly this rule, and a rule kept twice drifts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvfuse.tiers.base import TierStats

log = logging.getLogger(__name__)


class Backoff:
    """The back-off state of one remote tier: ``what`` names it in the log ("redis tier"),
    ``where`` is its address (with no password in it: ``config.secrets.redact_url``); ``stats`` gets
    an error per failure; ``hint(error)``: what to check, added to the logged failure. Thread-safe."""

    def __init__(
        self,
        what: str,
        where: str,
        backoff_s: float,
        stats: TierStats,
        recovered: str = "reachable again",
        hint: Callable[[Exception], str] | None = None,
    ) -> None:
        self.what, self.where, self.backoff_s = what, where, backoff_s
        self._stats = stats
        self._recovered = recovered
        self._hint = hint  # error -> what to check, appended to the logged failure ("" for none)
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether calls may try the server now (no back-off running)."""
        return time.monotonic() >= self._down_until

    def backing_off(self) -> bool:
        """True while calls are answered as misses without trying the server."""
        return not self.available()

    def failed(self, op: str, error: Exception) -> None:
        """``op`` failed with ``error``: count it, start (or restart) the back-off, log the first."""
        with self._lock:
            first = not self._down
            self._down = True
            self._down_until = time.monotonic() + self.backoff_s
        if first:
            try:
                hint = self._hint(error) if self._hint is not None else ""
            except Exception:  # a hint is a courtesy: never a reason for the failure path to fail
                hint = ""
            log.warning(
                "%s %s: %s failed (%s); backing off %.1fs%s",
                self.what,
                self.where,
                op,
                error,
                self.backoff_s,
                hint,
            )
        self._stats.add(errors=1)

    def succeeded(self) -> None:
        """A call got through: the server is back if it was away (logged once)."""
        if self._down:
            with self._lock:
                was_down, self._down = self._down, False
            if was_down:
                log.info("%s %s: %s", self.what, self.where, self._recovered)
