"""The engine's request queue, admission, the KV memory budget and preemption.

Two calls make a step's work, and neither calls back into the engine:

- ``schedule()``: the waiting sequences to drop (their client left: cancelled while queued), the
  ones to admit, and the running ones (every running sequence takes part in every step:
  continuous batching). Waiting sequences are admitted first come, first served, up to
  ``max_running`` at a time and while ``KVMemory`` can give them their cache; admission stops at
  the first one that does not fit, so a large request is never overtaken forever by small ones;
  one that could not fit even an empty budget is refused instead (``refused``), never waited for.
  A waiting prompt whose leading chunks a running sequence is computing is passed over, keeping
  its place (``ComputingChunks``), and loads them once they are stored.
- ``batch(running)``, once the admitted sequences are planned and loaded: this step's forward
  pass, a token for every decoding sequence, then prompt chunks (chunked prefill) within
  ``max_step_tokens``: the oldest prompt at least ``MIN_PREFILL_CHUNK`` tokens, then the shortest
  remaining prompts first (``prefill_shares``), so that a returning turn whose history is cached
  (a few dozen new tokens) joins the next pass instead of waiting behind a long cold prompt's
  passes (in LMCache's multi-round QA such a turn waited 3-6 s for a cold prompt's 2,048-token
  passes; it now shares the next one). A step
  with no decoding sequence takes prompt chunks up to ``max_prefill_tokens`` instead
  (``step_budget``): the small budget exists for the decodes' inter-token latency, and with none
  waiting a prompt is computed in fewer, longer passes, which is faster per token (each pass
  reads every weight once and runs longer products). A cache
  that cannot grow preempts the most recently admitted sequence (``preempt``: its KV freed, back
  at the front of the queue, keeping what it generated), itself last.

The queue holds at most ``max_waiting`` sequences; beyond that ``add`` raises ``QueueFull`` (the
server answers 429) instead of letting latency grow without bound. Its look-ahead (``lookahead()``:
which requests wait, in order, with the keys they will ask for) is what the store reads to
prefetch entries before the requests that need them run.

``add``/``remove`` come from other threads (the server's event loop); everything else from the
engine's. One condition variable guards the queue and wakes the engine loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kvfuse.config import EngineConfig, ServerConfig
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.transformer import BatchItem
from kvfuse.reuse.computing import ComputingChunks

from .kv_memory import KVMemory
from .request import QueueClosed, QueueFull, Request
from .sequence import Sequence, SequenceStatus
from .stats import bucket

log = logging.getLogger(__name__)

# Prompt tokens the oldest prompt being computed gets in every step, even when decodes use up
# engine.max_step_tokens: no prompt waits for the decodes to end.
MIN_PREFILL_CHUNK = 16
# Admission pauses after a cache allocation failure (``AdmissionBackoff``).
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 2.0


def step_budget(max_step_tokens: int, max_prefill_tokens: int | None, decoding: bool) -> int:
    """The tokens one step may run: ``max_step_tokens`` while any sequence decodes (their next
    tokens wait on the step), else the larger of it and ``max_prefill_tokens`` (None: unset)."""
    if decoding or max_prefill_tokens is None:
        return max_step_tokens
    return max(max_step_tokens, max_prefill_tokens)


def prefill_shares(fills: list[int], budget: int, floor: int = MIN_PREFILL_CHUNK) -> list[int]:
    """Prompt tokens each prefilling sequence computes in a step with ``budget`` tokens left:
    ``fills`` are their remaining prompt tokens, oldest first. The oldest gets at least ``floor``
    (no prompt starves under any load), then the shortest remaining ones are served first (ties:
    the older first) from what is left; a sequence's share is never more than its fill."""
    if not fills:
        return []
    shares = [0] * len(fills)
    shares[0] = min(fills[0], max(floor, 0))
    left = budget - shares[0]
    for i in sorted(range(len(fills)), key=lambda i: (fills[i], i)):
        take = min(fills[i] - shares[i], max(left, 0))
        shares[i] += take
        left -= take
    return shares


@dataclass
class ScheduledStep:
    """Which sequences one engine step ends, admits and runs."""

    skipped: list[Sequence] = field(default_factory=list)  # cancelled while waiting: finish them
    # failed at admission, with the error to end them with: larger than the whole KV budget, or
    # their cache could not be allocated (e.g. the device is out of memory)
    refused: list[tuple[Sequence, Exception]] = field(default_factory=list)
    # admitted now: plan, load, start their prefill
    admitted: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)  # every running sequence, oldest first

    @property
    def empty(self) -> bool:
        return not self.skipped and not self.refused and not self.running


@dataclass
class Batch:
    """One forward pass: each sequence with the tokens it computes now (one to decode, or the next
    chunk of its prompt), and the sequences preempted to make room for it."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # sequences whose cache failed to grow for another reason than the budget: end them
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.items)

    def forward_items(self) -> list[BatchItem]:
        """The runner's view of the pass: per sequence, the next ids of its prompt at their slots,
        or its last token."""
        out = []
        for seq, n in self.items:
            p = seq.prefill
            if p.fill:
                start = p.fill_start
                out.append(
                    BatchItem(
                        p.fill[:n],
                        seq.kv,
                        positions=torch.arange(start, start + n),
                        logits=n == len(p.fill),
                        start=start,
                    )
                )
            else:
                out.append(BatchItem([seq.token_ids[-1]], seq.kv))
        return out

    def counters(self) -> dict:
        """What this pass adds to the engine's counters (``EngineStats``)."""
        n, tokens = len(self.items), self.tokens
        return {
            "steps": 1,
            "step_sequences": n,
            "step_tokens": tokens,
            "batch_sizes": {bucket(n): 1},
            "step_token_counts": {bucket(tokens): 1},
        }


class AdmissionBackoff:
    """After a cache allocation failed (not the budget's refusal: a device out of memory), no
    sequence is admitted for a while, doubling with each failure in a row (``BACKOFF_FIRST_S``
    up to ``BACKOFF_MAX_S``): a persistent fault fails one waiting request per pause, not the
    whole queue at once, and the running ones go on meanwhile. A success resets it."""

    def __init__(self) -> None:
        self.failures = 0  # in a row
        self.until = 0.0  # time.monotonic() before which nothing is admitted

    def failed(self) -> None:
        self.failures += 1
        pause = min(BACKOFF_FIRST_S * 2 ** (self.failures - 1), BACKOFF_MAX_S)
        self.until = time.monotonic() + pause

    def reset(self) -> None:
        self.failures, self.until = 0, 0.0


class Scheduler:
    """FIFO admission with a bounded queue, within a KV budget; see the module docstring.

    ``memory`` None (tests of the queue alone): admission is bounded by ``max_running`` only."""

    def __init__(
        self,
        max_waiting: int = ServerConfig.max_queue,
        max_running: int = EngineConfig.max_running,
        memory: KVMemory | None = None,
        max_step_tokens: int = EngineConfig.max_step_tokens,
        computing: ComputingChunks | None = None,
        max_prefill_tokens: int | None = None,
    ):
        if max_waiting < 1 or max_running < 1 or max_step_tokens < 1:
            raise ValueError("max_waiting, max_running and max_step_tokens must be >= 1")
        self.max_waiting, self.max_running, self.max_step_tokens = (
            max_waiting,
            max_running,
            max_step_tokens,
        )
        self.max_prefill_tokens = max_prefill_tokens
        self.memory = memory
        # the cache engine's defer rule (its own bookkeeping when the queue is tested alone)
        self.computing = computing if computing is not None else ComputingChunks()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._cond = threading.Condition()
        self._closed = False
        self._backoff = AdmissionBackoff()
        self.skipped = 0  # sequences dropped because they were cancelled while waiting
        self.preempted = 0  # running sequences put back in the queue

    # -- other threads --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; QueueFull when ``max_waiting`` wait already, QueueClosed after close()."""
        with self._cond:
            if self._closed:
                raise QueueClosed("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(
                    f"{len(self._waiting)} requests are already waiting (max_queue = {self.max_waiting})"
                )
            seq.status = SequenceStatus.WAITING
            self._waiting.append(seq)
            self._cond.notify_all()

    def remove(self, request: Request) -> list[Sequence]:
        """Take ``request``'s sequences (its choices) out of the queue if they still wait (its
        client left), and return them; none if none waits (they run, or are done)."""
        with self._cond:
            out = [s for s in self._waiting if s.request is request]
            for seq in out:
                self._waiting.remove(seq)
            self.skipped += sum(1 for s in out if s.choice == 0)
            return out

    def close(self) -> list[Sequence]:
        """Refuse new sequences; remove and return the waiting ones."""
        with self._cond:
            self._closed = True
            out = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
            return out

    def wake(self) -> None:
        """Wake a ``wait_for_work`` (e.g. a running request was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    # -- the engine thread ----------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """The next step: drop cancelled waiting sequences, admit the oldest waiting ones while
        there is room and memory, run everything running (see the module docstring). When nothing
        can run although sequences wait, waits a little for KV memory to come back."""
        step = ScheduledStep()
        with self._cond:
            step.skipped = [s for s in self._waiting if s.request.cancel.is_set()]
            self._waiting = deque(s for s in self._waiting if not s.request.cancel.is_set())
            self.skipped += len(step.skipped)
            for seq in list(self._waiting) if time.monotonic() >= self._backoff.until else ():
                if self._running and self._places() + seq.width > self.max_running:
                    break
                if self.computing.blocks(seq.reuse):
                    continue  # keeps its place; later ones may be admitted
                if self.memory is not None:
                    fits = self._allocate(seq, step)
                    if fits is None:
                        break  # its cache could not be allocated: it failed; back off a while
                    if not fits:
                        why = self.memory.never_fits(seq)
                        if why is None:
                            break  # it fits once memory comes back: nothing overtakes it
                        self._waiting.remove(seq)  # it never would: it must not block the queue
                        step.refused.append((seq, ValueError(why)))
                        continue
                self._start(seq)
                step.admitted.append(seq)
            step.running = [s for s in self._running if s.status is SequenceStatus.RUNNING]
            starved = not step.running and step.empty and bool(self._waiting)
        if starved and self.memory is not None:
            self.memory.wait_for_release()
        return step

    def _places(self) -> int:
        """Running places taken (under the lock): a request's ``n`` choices count from its
        admission, so that they can fork into running places once its prompt is computed."""
        return sum(s.width for s in self._running)

    def adopt(self, seq: Sequence) -> bool:
        """A forked choice (its KV copied) runs from now on, if a running place is free (its
        request's admission reserved one); False if none is: the caller queues it instead."""
        with self._cond:
            if self._places() >= self.max_running:
                return False
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            return True

    def requeue(self, seqs: list[Sequence]) -> None:
        """Forked choices that could not run now wait at the front of the queue, in order (they
        were accepted already: never refused for a full queue)."""
        with self._cond:
            for seq in reversed(seqs):
                seq.status = SequenceStatus.WAITING
                self._waiting.appendleft(seq)
            self._cond.notify_all()

    def _allocate(self, seq: Sequence, step: ScheduledStep) -> bool | None:
        """``KVMemory.allocate`` (under the lock); None when it raised something other than the
        budget's refusal (a device out of memory, an allocator failure): ``seq`` then fails with
        that error, out of the queue, rather than raise out of every step while everything waits
        behind it, and admission backs off (``AdmissionBackoff``) in case the fault persists."""
        try:
            fits = self.memory.allocate(seq)
        except Exception as e:
            log.error(
                "request %s: its KV cache could not be allocated: %r", seq.request.request_id, e
            )
            e.__traceback__ = None  # its frames would hold the sequence
            self._waiting.remove(seq)
            step.refused.append((seq, e))
            self._backoff.failed()
            return None
        if fits:
            self._backoff.reset()
        return fits

    def _start(self, seq: Sequence) -> None:
        """``seq`` leaves the queue and runs (under the lock)."""
        self._waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.request.started_at is None:
            seq.request.started_at = time.monotonic()
        self._running.append(seq)
        self.computing.admitted(seq.reuse)

    def batch(self, running: list[Sequence]) -> Batch:
        """This step's forward pass over ``running`` (see the module docstring). Makes room in the
        KV budget first, preempting if needed; a preempted sequence is not in the batch."""
        out = Batch()
        decoding = [s for s in running if s.decoding]
        filling = [s for s in running if s.prefill.fill and not s.request.cancel.is_set()]
        # Decodes always run; prompt chunks share what is left of the token budget.
        budget = step_budget(self.max_step_tokens, self.max_prefill_tokens, bool(decoding))
        budget -= len(decoding)
        shares = prefill_shares([len(s.prefill.fill) for s in filling], budget)
        order = [(s, 1) for s in decoding] + [(s, n) for s, n in zip(filling, shares) if n > 0]
        for seq, n in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an older one
            fill = seq.prefill.fill
            end = (seq.prefill.fill_start if fill else seq.kv.length) + n
            if not self._make_room(seq, end, out.preempted, out.failed):
                continue
            out.items.append((seq, n))
        # Room was made before any item refers to a cache: a preempted sequence's KV is free now.
        out.items = [(seq, n) for seq, n in out.items if seq.status is SequenceStatus.RUNNING]
        return out

    def _grow(self, seq: Sequence, total: int, failed: list[tuple[Sequence, Exception]]) -> bool:
        """``KVMemory.grow``; an error other than the budget's refusal fails ``seq`` (it goes
        into ``failed`` for the engine to end) instead of raising out of the step."""
        try:
            return self.memory.grow(seq, total)
        except Exception as e:
            log.error("request %s: its KV cache could not grow: %r", seq.request.request_id, e)
            e.__traceback__ = None
            failed.append((seq, e))
            self._backoff.failed()
            return False

    def _make_room(
        self,
        seq: Sequence,
        total: int,
        preempted: list[Sequence],
        failed: list[tuple[Sequence, Exception]],
    ) -> bool:
        """Grow ``seq``'s KV to ``total`` slots, preempting the most recently admitted running
        sequences (``seq`` itself last) until it fits. False if ``seq`` was preempted, or failed."""
        while self.memory is not None and not self._grow(seq, total, failed):
            broken = [s for s, _ in failed]
            if seq in broken:
                return False
            # a sequence being loaded off the step is not a victim: its cache is in use; nor one
            # that failed: the engine ends it
            victims = [
                s
                for s in self.running()
                if s.status is SequenceStatus.RUNNING and not s.loading and s not in broken
            ]
            victim = next((s for s in reversed(victims) if s is not seq), seq)
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free running ``seq``'s KV (``KVMemory.release``) and put it back at the front of the
        queue, keeping its tokens: it is admitted again before anything that arrived after it. Not
        refused when the queue is full: it was accepted already."""
        log.info(
            "request %s preempted (KV budget full) after %d tokens",
            seq.request.request_id,
            len(seq.token_ids),
        )
        if self.memory is not None and seq.kv is not None:
            self.memory.release(seq)
        self.computing.done(seq.reuse)
        seq.preempted()
        with self._cond:
            if seq in self._running:
                self._running.remove(seq)
            seq.status = SequenceStatus.WAITING
            self._waiting.appendleft(seq)
            self.preempted += 1

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done (whatever the reason): it leaves the running set."""
        self.computing.done(seq.reuse)
        with self._cond:
            seq.status = SequenceStatus.FINISHED
            if seq in self._running:
                self._running.remove(seq)

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._waiting or self._running)

    def pause(self, timeout: float) -> None:
        """Wait up to ``timeout`` for something to happen (a submit, a finished load: ``wake``)."""
        with self._cond:
            self._cond.wait(timeout)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until something waits or runs (True), or ``timeout`` passes / close() (False)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._waiting or self._running or self._closed, timeout
            ) and bool(self._waiting or self._running)

    # -- views ----------------------------------------------------------------------------------

    def waiting(self) -> list[Sequence]:
        """The waiting sequences, oldest first (a snapshot)."""
        with self._cond:
            return list(self._waiting)

    def running(self) -> list[Sequence]:
        with self._cond:
            return list(self._running)

    def lookahead(self) -> list[tuple[str, list[ChunkKey]]]:
        """``(request id, planned keys)`` of every waiting sequence, in the order they will run."""
        with self._cond:
            return [
                (s.request.request_id, s.reuse.keys.all() if s.reuse.keys is not None else [])
                for s in self._waiting
            ]

    def upcoming_keys(self) -> list[ChunkKey]:
        """Every key the waiting sequences will ask for, in run order, each once."""
        return list(dict.fromkeys(k for _, keys in self.lookahead() for k in keys))

    def state(self) -> dict[str, int]:
        """Queue and memory figures for the server (``/v1/kv/stats``, ``/metrics``)."""
        out = {
            "waiting": len(self),
            "running": len(self.running()),
            "max_queue": self.max_waiting,
            "skipped": self.skipped,
            "max_running": self.max_running,
            "preempted": self.preempted,
        }
        if self.memory is not None:
            out.update(self.memory.state())
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)
