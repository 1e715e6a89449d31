"""The chunks running sequences are computing now, and will store.

A waiting prompt whose leading chunks a running sequence (or one admitted in this very step) is
computing is passed over until they are stored, then loads them: a burst of questions over one
document set computes it once, not once per request batched alongside. ``ComputingChunks`` is
that bookkeeping: ``admitted`` marks a sequence's whole prefix while it is not planned yet,
``computing`` the chunks its plan stores once it is, ``done`` clears them when they are handed to
the saver (or never will be), and ``blocks`` is the scheduler's test.
"""

from __future__ import annotations

from kvfuse.engine.sequence import Sequence
from kvfuse.kv.keys import ChunkKey


class ComputingChunks:
    """See the module docstring. Used by the engine's thread only."""

    def __init__(self) -> None:
        self._computing: set[ChunkKey] = set()  # chunks running sequences compute and will store
        self._admitting: set[ChunkKey] = set()  # prefix keys of the sequences admitted in this step

    def begin_step(self) -> None:
        """A new step: the sequences admitted in the last one are planned by now."""
        self._admitting = set()

    def admitted(self, seq: Sequence) -> None:
        """``seq`` was admitted in this step: not planned yet, so all of its prefix counts as computing."""
        if seq.keys is not None and not seq.started:
            self._admitting.update(seq.keys.prefix)

    def computing(self, seq: Sequence) -> None:
        """``seq`` was planned: it computes and will store the chunks of its plan.s saves."""
        plan = seq.prefill.plan
        if plan.saves and not seq.started:
            seq.prefill.computing = frozenset(st.key for st in plan.saves)
            self._computing |= seq.prefill.computing

    def done(self, seq: Sequence) -> None:
        """``seq``'s new chunks are handed to the saver (or never will be): others may load them."""
        if seq.prefill.computing:
            self._computing -= seq.prefill.computing
            seq.prefill.computing = frozenset()

    def blocks(self, seq: Sequence) -> bool:
        """Whether a running sequence is computing one of ``seq``'s chunks now: ``seq`` then waits
        a step or a few and loads it, rather than computing it a second time in the same batch."""
        if seq.keys is None or not (self._computing or self._admitting):
            return False
        return any(k in self._computing or k in self._admitting for k in seq.keys.prefix)
