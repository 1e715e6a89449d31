"""The worker side: moving chunks between kvfuse's store and vLLM's paged KV tensors (no vLLM here:
it sees tensors, a ``BlockLayout`` and the scheduler's ``StepPlan``).

Loads (before the forward pass reads the KV): with ``layerwise`` a thread reads layer 0 of every
chunk of the step (``TieredStore.fetch_layers``: from disk or Redis only those bytes, checked
against their checksums), writes it into vLLM's blocks, signals layer 0, then reads and writes
layer 1, then layers 2-3, 4-7, ... (``layer_groups``); vLLM's attention layer ``i`` waits for
exactly layer ``i`` (``wait_layer``), so reading overlaps the forward pass. Without it, whole entries are fetched (and promoted into the memory tier) and written
before the forward pass starts. A chunk that cannot be read or is not what was expected (missing,
damaged, another shape) is never written further: its blocks are reported failed
(``take_failed_blocks``) and vLLM recomputes them.

Saves (prompt chunks the step completes): as each attention layer finishes, its KV for those
chunks is copied out of vLLM's blocks (``save_layer``: one gather per layer); after the step the
complete chunks go to a saver thread that encodes them (the configured codec) and puts them into
the store, whose lower tiers are written in the background. The forward pass only pays the
copies; vLLM's blocks can be freed as soon as the step ends. A chunk missing a layer is never
stored.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from kvfuse.codecs.base import Codec
from kvfuse.counters import Counters
from kvfuse.integrations.vllm.blocks import kernel_block_ids
from kvfuse.integrations.vllm.layout import BlockLayout
from kvfuse.integrations.vllm.plan import LoadChunk, LoadJob, SaveChunk
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import EntrySpec, encode_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.store import TieredStore
from kvfuse.threads import helper_thread

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class WorkerCounters(Counters):
    """The worker side's statistics (times in microseconds)."""

    load_requests: int = 0
    loaded_chunks: int = 0
    loaded_tokens: int = 0  # tokens written into vLLM's blocks
    loaded_chunks_by_tier: dict[str, int] = field(default_factory=dict)
    load_failed_chunks: int = 0
    load_failed_blocks: int = 0
    load_us: int = 0  # from the start of a step's loads to its last layer written
    load_wait_us: int = 0  # how long the forward pass waited for layers
    saved_chunks: int = 0
    saved_tokens: int = 0
    save_dropped: int = 0  # chunks not saved: the save queue was full, or a layer was missing
    save_errors: int = 0
    save_copy_us: int = 0  # time on the forward path copying KV out for saves


def layer_groups(num_layers: int) -> list[tuple[int, int]]:
    """The layer ranges a layer-wise load reads, one after the other: 1, 1, 2, 4, 8, ... layers
    (the first layers arrive at once; later, larger reads cost fewer round trips)."""
    out, start, size = [], 0, 1
    while start < num_layers:
        out.append((start, min(num_layers, start + size)))
        start += size
        size = size if len(out) == 1 else size * 2
    return out


class CacheLayers:
    """vLLM's per-layer KV tensors in layer order, with their block layout."""

    def __init__(
        self,
        views: Mapping[str, torch.Tensor],
        order: Sequence[str],
        layout: BlockLayout,
        block_size: int,
    ):
        missing = [n for n in order if n not in views]
        if missing:
            raise ValueError(f"no KV cache registered for layers {missing}")
        self.names = list(order)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.views = [views[n] for n in self.names]
        self.layout = layout
        self.block_size = block_size
        # checks that kernel blocks divide vLLM's blocks
        kernel_block_ids([], block_size, layout.block_tokens)

    def __len__(self) -> int:
        return len(self.names)

    def kernel_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = kernel_block_ids(block_ids, self.block_size, self.layout.block_tokens)
        return torch.tensor(ids, dtype=torch.int64)


@dataclass
class _LoadItem:
    chunk: LoadChunk
    key: ChunkKey | None
    blocks: torch.Tensor  # kernel blocks written
    spec: EntrySpec
    tier: str | None = None
    failed: bool = False


class _StepLoad:
    """The loads of one step, done on a thread layer by layer (or all at once)."""

    def __init__(self, items: list[_LoadItem], num_layers: int) -> None:
        self.items = items
        self.events = [threading.Event() for _ in range(num_layers)]
        self.thread: threading.Thread | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None


class KVWorker:
    """Loads and saves for one worker (one tensor-parallel rank)."""

    def __init__(
        self,
        store: TieredStore,
        codec: Codec,
        layers: CacheLayers,
        *,
        dtype: torch.dtype,
        kv_heads: int,
        head_dim: int,
        chunk_size: int,
        rank: int = 0,
        layerwise: bool = True,
        save_queue: int = 64,
    ) -> None:
        self.store, self.codec, self.layers = store, codec, layers
        self.dtype, self.kv_heads, self.head_dim = dtype, kv_heads, head_dim
        self.chunk_size, self.rank, self.layerwise = chunk_size, rank, layerwise
        self.counters = WorkerCounters()
        self._load: _StepLoad | None = None
        self._failed_blocks: set[int] = set()
        # saves of the current step: one buffer (layers, 2, chunks * chunk_size, heads, dim), the layers copied
        self._save_buf: torch.Tensor | None = None
        self._save_plan: tuple[SaveChunk, ...] = ()
        self._save_layers: set[int] = set()
        self._save_blocks: torch.Tensor | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=save_queue)
        self._saver = helper_thread(self._save_loop, "kvfuse-vllm-saver")
        self._saver.start()
        self._closed = False

    # -- loads -----------------------------------------------------------------------------------

    def _spec(self, index: int, token_ids: Sequence[int] = ()) -> EntrySpec:
        """What a chunk's entry must be: this model's KV layout and dtype, the chunk's positions,
        and (when the scheduler sent them) the chunk's token ids."""
        c = self.chunk_size
        return EntrySpec(
            self.dtype,
            len(self.layers),
            self.kv_heads,
            self.head_dim,
            tokens=c,
            first_position=index * c,
            token_ids=tuple(token_ids) if token_ids else None,
        )

    def start_loads(self, jobs: Sequence[LoadJob]) -> None:
        """Start the loads of a step (before its forward pass)."""
        self.finish_loads()
        items = []
        for job in jobs:
            for c in job.chunks:
                key = None
                if len(c.keys) > self.rank:
                    try:
                        key = ChunkKey.parse(c.keys[self.rank])
                    except ValueError:
                        key = None
                item = _LoadItem(
                    c, key, self.layers.kernel_blocks(c.block_ids), self._spec(c.index, c.token_ids)
                )
                if key is None:
                    self._fail(item, "no key for this rank")
                elif (
                    c.skip_tokens + self._tokens(item) > self.chunk_size
                    or c.skip_tokens % self.layers.block_size
                ):
                    self._fail(
                        item,
                        f"blocks {c.block_ids} from token {c.skip_tokens} do not fit in a chunk",
                    )
                items.append(item)
        if not items:
            return
        self.counters.add(load_requests=len(jobs))
        load = self._load = _StepLoad(items, len(self.layers))
        if self.layerwise:
            load.thread = helper_thread(self._run_layers, "kvfuse-vllm-loader", (load,))
            load.thread.start()
        else:
            self._run_whole(load)

    def _tokens(self, item: _LoadItem) -> int:
        """The tokens a load item writes: its blocks' worth."""
        return len(item.chunk.block_ids) * self.layers.block_size

    def _fail(self, item: _LoadItem, why: str) -> None:
        if item.failed:
            return
        item.failed = True
        self._failed_blocks.update(item.chunk.block_ids)
        self.counters.add(load_failed_chunks=1, load_failed_blocks=len(item.chunk.block_ids))
        log.warning(
            "kvfuse: chunk %d (%s) not loaded: %s; vLLM recomputes its %d blocks",
            item.chunk.index,
            item.chunk.keys[self.rank] if len(item.chunk.keys) > self.rank else "?",
            why,
            len(item.chunk.block_ids),
        )

    def _write_layer(self, layer: int, parts: list[tuple[_LoadItem, torch.Tensor]]) -> None:
        """Write one layer of several chunks: ``parts`` holds each chunk's ``(2, tokens, heads,
        dim)`` KV, from which the tokens vLLM holds already are skipped."""
        if not parts:
            return
        blocks = torch.cat([it.blocks for it, _ in parts])
        kv = torch.cat(
            [
                x[:, it.chunk.skip_tokens : it.chunk.skip_tokens + self._tokens(it)]
                for it, x in parts
            ],
            dim=1,
        )
        try:
            view = self.layers.views[layer]
            self.layers.layout.scatter(view, blocks, kv)
            if view.is_cuda:  # the forward pass may run on another stream: finish the copies first
                torch.cuda.current_stream(view.device).synchronize()
        except Exception as e:  # nothing half-written may be used: fail every chunk of this write
            log.exception("kvfuse: writing layer %d failed", layer)
            for it, _ in parts:
                self._fail(it, f"writing layer {layer} failed: {e}")

    def _run_layers(self, load: _StepLoad) -> None:
        layer = 0
        try:
            for first, last in layer_groups(len(self.layers)):
                got: list[tuple[_LoadItem, torch.Tensor]] = []
                for it in load.items:
                    if it.failed:
                        continue
                    r = self.store.fetch_layers(it.key, first, last, it.spec)
                    if r is None:
                        self._fail(
                            it, f"layers {first}-{last - 1} are missing or damaged in every tier"
                        )
                        continue
                    if first == 0:
                        it.tier = r.tier
                    got.append((it, r.kv))
                for layer in range(first, last):
                    self._write_layer(
                        layer, [(it, kv[layer - first]) for it, kv in got if not it.failed]
                    )
                    load.events[layer].set()
        except Exception as e:
            log.exception("kvfuse: the layer loader failed at layer %d", layer)
            for it in load.items:
                self._fail(it, f"loader error: {e}")
        finally:
            load.finished = time.perf_counter()
            for ev in load.events:
                ev.set()

    def _run_whole(self, load: _StepLoad) -> None:
        try:
            live = [it for it in load.items if not it.failed]
            fetched = self.store.fetch([it.key for it in live], [it.spec for it in live])
            entries = []
            for it, f in zip(live, fetched):
                if f.entry is None:
                    self._fail(it, "missing or damaged in every tier")
                else:
                    it.tier = f.tier
                    entries.append((it, f.entry))
            for layer in range(len(self.layers)):
                parts = []
                for it, entry in entries:
                    if it.failed:
                        continue
                    try:
                        parts.append((it, entry.decode(layer, layer + 1)[0]))
                    except ValueError as e:
                        self._fail(it, f"layer {layer} does not decode: {e}")
                self._write_layer(layer, parts)
        except Exception as e:
            log.exception("kvfuse: loading failed")
            for it in load.items:
                self._fail(it, f"loader error: {e}")
        finally:
            load.finished = time.perf_counter()
            for ev in load.events:
                ev.set()

    def wait_layer(self, name: str) -> None:
        """Block until layer ``name``'s loaded KV is written (immediately when nothing loads)."""
        load = self._load
        if load is None:
            return
        i = self.layers.index.get(name)
        if i is None or load.events[i].is_set():
            return
        t0 = time.perf_counter()
        load.events[i].wait()
        self.counters.add(load_wait_us=int((time.perf_counter() - t0) * 1e6))

    def finish_loads(self) -> None:
        """Wait for the current step's loads and account for them."""
        load, self._load = self._load, None
        if load is None:
            return
        if load.thread is not None:
            load.thread.join()
        ok = [it for it in load.items if not it.failed]
        tiers: dict[str, int] = {}
        for it in ok:
            tiers[it.tier or "unknown"] = tiers.get(it.tier or "unknown", 0) + 1
        tokens = sum(self._tokens(it) for it in ok)
        elapsed = (load.finished or time.perf_counter()) - load.started
        self.counters.add(
            loaded_chunks=len(ok),
            loaded_tokens=tokens,
            loaded_chunks_by_tier=tiers,
            load_us=int(elapsed * 1e6),
        )
        if ok:
            log.info(
                "kvfuse: loaded %d chunks (%d tokens) in %.1f ms from %s%s",
                len(ok),
                tokens,
                elapsed * 1e3,
                ", ".join(f"{t}: {n}" for t, n in sorted(tiers.items())),
                f"; {len(load.items) - len(ok)} failed" if len(ok) < len(load.items) else "",
            )

    def take_failed_blocks(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (after the step's loads end)."""
        self.finish_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves -----------------------------------------------------------------------------------

    def save_layer(self, name: str, view: torch.Tensor, saves: Sequence[SaveChunk]) -> None:
        """Copy layer ``name``'s KV of this step's save chunks out of ``view`` (its KV tensor)."""
        if not saves:
            return
        i = self.layers.index.get(name)
        if i is None:
            return
        t0 = time.perf_counter()
        saves = tuple(saves)
        if self._save_plan != saves:  # the step's first layer
            self._save_plan, self._save_layers = saves, set()
            self._save_blocks = torch.cat([self.layers.kernel_blocks(s.block_ids) for s in saves])
            self._save_buf = torch.empty(
                len(self.layers),
                2,
                len(saves) * self.chunk_size,
                self.kv_heads,
                self.head_dim,
                dtype=self.dtype,
                device=view.device,
            )
        self.layers.layout.gather(view, self._save_blocks, out=self._save_buf[i])
        self._save_layers.add(i)
        self.counters.add(save_copy_us=int((time.perf_counter() - t0) * 1e6))

    def end_step(self) -> None:
        """After the forward pass: hand this step's complete save chunks to the saver thread."""
        saves, buf, layers = self._save_plan, self._save_buf, self._save_layers
        self._save_plan, self._save_buf, self._save_layers, self._save_blocks = (
            (),
            None,
            set(),
            None,
        )
        if not saves or buf is None:
            return
        if len(layers) != len(self.layers):
            self.counters.add(save_dropped=len(saves))
            log.warning(
                "kvfuse: %d chunks not saved: only %d of %d layers were copied",
                len(saves),
                len(layers),
                len(self.layers),
            )
            return
        if buf.device.type != "cpu":
            buf = buf.cpu()
        c = self.chunk_size
        for j, s in enumerate(saves):
            if len(s.keys) <= self.rank:
                self.counters.add(save_errors=1)
                continue
            try:  # the chunk's KV is made contiguous (copied) on the saver thread, off the forward path
                self._queue.put_nowait(
                    (s.keys[self.rank], s.index, s.token_ids, buf[:, :, j * c : (j + 1) * c])
                )
            except queue.Full:
                self.counters.add(save_dropped=1)
                log.warning(
                    "kvfuse: the save queue is full; chunk %d of request %s is not saved",
                    s.index,
                    s.req_id,
                )

    def _save_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                key, index, token_ids, kv = item
                try:
                    c = self.chunk_size
                    chunk = KVChunk(
                        kv.contiguous(),
                        torch.arange(index * c, (index + 1) * c, dtype=torch.int64),
                        token_ids=torch.tensor(token_ids, dtype=torch.int64) if token_ids else None,
                    )
                    entry = encode_entry(chunk, key, self.codec)
                    self.store.put([(ChunkKey.parse(key), entry)], block=True)
                    self.counters.add(saved_chunks=1, saved_tokens=chunk.num_tokens)
                except Exception:
                    self.counters.add(save_errors=1)
                    log.exception("kvfuse: saving %s failed", key)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued saves are in the store (and its lower tiers written)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = threading.Event()

        def wait_queue():
            self._queue.join()
            done.set()

        threading.Thread(target=wait_queue, daemon=True).start()
        if not done.wait(timeout):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.store.flush(left)

    def close(self) -> None:
        """Finish loads, store the queued saves, stop the saver thread."""
        if self._closed:
            return
        self._closed = True
        self.finish_loads()
        self._queue.put(_STOP)
        self._saver.join()
