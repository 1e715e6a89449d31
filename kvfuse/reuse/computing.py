"""The chunks running sequences are computing now, and will store.

A waiting prompt whose leading chunks a running sequence (or one admitted in this very step) is
computing is passed over until they are stored, then loads them: a burst of questions over one
document set computes it once, not once per request batched alongside. ``ComputingChunks`` is
that bookkeeping: ``admitted`` marks a sequence's whole prefix while it is not planned yet (its
plan is made off the engine's step, so that can take a few steps), ``planned`` the chunks its
plan stores once it is, ``done`` clears them when they are handed to the saver (or never will
be), and ``blocks`` is the scheduler's test.
"""

from __future__ import annotations

from collections import Counter

from kvfuse.kv.keys import ChunkKey

from .state import Reuse


class ComputingChunks:
    """See the module docstring. Used by the engine's thread only."""

    def __init__(self) -> None:
        # chunks running sequences compute and will store, and the prefixes of sequences
        # admitted but not planned yet; counted, since two sequences can name the same chunk
        self._busy: Counter[ChunkKey] = Counter()

    def admitted(self, r: Reuse) -> None:
        """``r`` was admitted: not planned yet, so all of its prefix counts as computing."""
        if r.keys is not None and not r.counted:
            self._mark(r, frozenset(r.keys.prefix))

    def planned(self, r: Reuse) -> None:
        """``r`` was planned: it computes and will store the chunks of its plan's saves."""
        self._mark(r, frozenset(s.key for s in r.plan.saves) if not r.counted else frozenset())

    def done(self, r: Reuse) -> None:
        """``r``'s new chunks are handed to the saver (or never will be): others may load them."""
        self._mark(r, frozenset())

    def blocks(self, r: Reuse) -> bool:
        """Whether a running sequence is computing one of ``r``'s chunks now: ``r`` then waits a
        step or a few and loads it, rather than computing it a second time in the same batch."""
        if r.keys is None or not self._busy:
            return False
        return any(k in self._busy for k in r.keys.prefix)

    def _mark(self, r: Reuse, keys: frozenset[ChunkKey]) -> None:
        self._busy.subtract(r.computing)
        self._busy.update(keys)
        self._busy = +self._busy
        r.computing = keys
