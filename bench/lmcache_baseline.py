"""LMCache 0.5.6 store/retrieve throughput on CPU: the baseline of ``bench/store.py``.

Runs inside the LMCache venv (``bench/setup_lmcache.sh``), never in kvfuse's: ``bench/store.py``
starts it as a subprocess with that venv's python. It reads the very KV tensors kvfuse stores (a
``.pt`` file written by ``bench/store.py``: ``{"kv": (chunks, layers, 2, 256, heads, dim),
"tokens": int64 (chunks * 256,)}``), drives ``LMCacheEngine.store`` / ``retrieve`` over one of its
backends and prints one JSON object on stdout (everything else goes to stderr).

How each backend is made comparable to the matching kvfuse tier:

- The stock ``MockGPUConnector`` copies nothing; ``CopyingConnector`` below really copies each
  256-token chunk between the "GPU" KV tensor ``(layers, 2, tokens, heads, dim)`` and LMCache's
  memory object (its ``KV_2LTD`` layout ``(2, layers, tokens, heads*dim)``), as a real connector
  does. A store = allocate + copy out + put; a retrieve = lookup + get + copy into the destination.
  The round trip is checked bit-exact once per backend (``roundtrip_exact`` in the output).
- ``cpu``: LocalCPUBackend only (``local_cpu=True``); the store is synchronous.
- ``disk`` / ``redis``: ``local_cpu=False``. LMCache then keeps the LocalCPUBackend only as the
  allocator of staging buffers: it stores nothing in it and promotes nothing into it on a hit, so
  every retrieve really reads the disk files / the Redis server. (A fresh engine over the same
  disk directory would not work in 0.5.6: the disk index lives in memory only, a new engine sees
  no entries.) Stores to these backends are asynchronous (a worker pool / the asyncio loop); a
  store is timed from ``store()`` until every chunk has landed in the tier (polled every 0.5 ms,
  see ``_landed_check``), which is what kvfuse's synchronous tier put measures.
- Before each store the previous run's entries are removed (untimed), so every store writes anew.
- Disk reads hit the page cache, as the kvfuse and raw-file reads of ``bench/store.py`` do.

Throughput is KV bytes (layers * 2 * tokens * heads * dim * element size) / 1e6 / seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kv", required=True, help=".pt file written by bench/store.py (kv + tokens)")
    p.add_argument("--backend", required=True, choices=["cpu", "disk", "redis"])
    p.add_argument(
        "--disk-dir", help="directory for the disk backend (a fresh subdirectory is used)"
    )
    p.add_argument(
        "--redis-url", help="redis://127.0.0.1:PORT for the redis backend (the DB is flushed)"
    )
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--runs", type=int, default=5, help="timed runs (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for the connector copies (default 1: on a busy 2-core machine "
        "2 threads made the copies 3x slower; a real connector copies on the GPU anyway)",
    )
    return p.parse_args(argv)


def _connector_class():
    """MockGPUConnector that really moves the bytes (the stock one copies nothing)."""
    import torch
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    class CopyingConnector(MockGPUConnector):
        """MockGPUConnector that really moves the bytes (the stock one copies nothing)."""

        @staticmethod
        def _slot(
            memory_obj, kv: torch.Tensor, start: int, end: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # memory object: (2, layers, tokens, heads*dim); engine KV: (layers, 2, tokens, heads, dim)
            # Both sides as (layers, 2, tokens*heads*dim) with a contiguous last dim: torch then copies
            # 2 * layers contiguous blocks (about 3x faster on CPU than the equivalent 5-d permute).
            layers = kv.shape[0]
            view = memory_obj.tensor.view(2, layers, -1).transpose(0, 1)
            return view, kv[:, :, start:end].reshape(layers, 2, -1)

        def from_gpu(self, memory_obj, start, end, **kwargs):
            dst, src = self._slot(memory_obj, kwargs["kvcaches"], start, end)
            dst.copy_(src)

        def to_gpu(self, memory_obj, start, end, **kwargs):
            src, dst = self._slot(memory_obj, kwargs["kvcaches"], start, end)
            dst.copy_(src)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(obj, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(obj, s, e, **kwargs)

    return CopyingConnector


def _engine_config(args, kv_shape, dtype, disk_dir):
    from lmcache.v1.config import LMCacheEngineConfig

    total_gb = kv_shape[0] * 2 * kv_shape[2] * kv_shape[3] * kv_shape[4] * dtype.itemsize / 1e9
    # cpu: room for all chunks (the tier under test). disk/redis: only staging buffers, which a
    # retrieve allocates for all chunks at once, so the same size; it holds no entries there.
    cpu_gb = max(0.25, 2.5 * total_gb)
    common = dict(chunk_size=args.chunk_size, max_local_cpu_size=cpu_gb, save_unfull_chunk=False)
    if args.backend == "cpu":
        return LMCacheEngineConfig.from_defaults(local_cpu=True, **common)
    if args.backend == "disk":
        return LMCacheEngineConfig.from_defaults(
            local_cpu=False,
            local_disk=f"file://{disk_dir}/",
            max_local_disk_size=max(1.0, 50 * total_gb),
            **common,
        )
    return LMCacheEngineConfig.from_defaults(
        local_cpu=False, remote_url=args.redis_url, remote_serde="naive", **common
    )


def _build_engine(args, kv_shape, dtype, disk_dir):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.metadata import LMCacheMetadata

    config = _engine_config(args, kv_shape, dtype, disk_dir)
    chunk_shape = (kv_shape[0], 2, args.chunk_size, kv_shape[3], kv_shape[4])
    metadata = LMCacheMetadata(
        model_name="kvfuse-bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=chunk_shape,
    )
    name = f"kvfuse-bench-{args.backend}-{os.getpid()}"
    engine = LMCacheEngineBuilder.get_or_create(
        name,
        config,
        metadata,
        _connector_class()(chunk_shape),
        lambda *a, **k: None,
        lambda *a, **k: None,
    )
    engine.post_init()  # creates the storage manager and its backends (the vLLM adapter does this too)
    return name, engine


def _landed_check(engine, keys, args, redis_client):
    """A cheap "has every chunk landed?" probe that stays off LMCache's own event loop and worker
    threads (polling ``engine.lookup`` would queue EXISTS jobs on the very loop doing the puts).
    Disk: the backend indexes a key only after its file is written. Redis: the connector writes
    ``<key>kv_bytes`` first and ``<key>metadata`` second, so all metadata keys = all landed."""
    if args.backend == "disk":
        disk = engine.storage_manager.storage_backends["LocalDiskBackend"]
        return lambda: all(k in disk.dict for k in keys)
    names = [k.to_string() + "metadata" for k in keys]
    return lambda: redis_client.exists(*names) == len(names)


def _wait_landed(landed, timeout_s: float = 120.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not landed():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"LMCache store did not land within {timeout_s}s")
        time.sleep(0.0005)


def _served_by(engine, tokens) -> dict:
    """Which backend holds each chunk after a retrieve (the order retrieve searches them), and how
    many entries the CPU backend holds: 0 for disk/redis proves nothing was promoted to memory."""
    infos = [
        (key, start, end) for start, end, key in engine.token_database.process_tokens(tokens=tokens)
    ]
    mapping = engine.storage_manager.get_block_mapping(infos)
    cpu = engine.storage_manager.local_cpu_backend
    return {
        "chunks_per_backend": {name: len(blocks) for name, blocks in mapping.items()},
        "cpu_backend_entries": len(cpu.hot_cache) if cpu is not None else None,
    }


def _destroy(builder, name: str, timeout_s: float = 5.0) -> bool:
    """``LMCacheEngineBuilder.destroy`` in a daemon thread: with a Redis backend, 0.5.6 deadlocks in
    ``RedisConnector.close`` (it waits, on the asyncio loop thread, for a job that needs that very
    loop). The measurements are complete by then; False tells the caller the close hung."""
    t = threading.Thread(target=builder.destroy, args=(name,), daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def _clear(engine, keys, args, redis_client) -> None:
    if args.backend == "redis":
        redis_client.flushdb()
    elif args.backend == "disk":
        engine.storage_manager.batched_remove(keys, ["LocalDiskBackend"])
    else:
        engine.storage_manager.clear(["LocalCPUBackend"])
    if engine.lookup(args._tokens) != 0:
        raise RuntimeError("LMCache entries survived the clear between runs")


def _source(args):
    """The engine's KV tensor (what a GPU connector would read): all chunks back to back; the
    prompt's tokens; the chunks' shape."""
    import torch

    data = torch.load(args.kv, weights_only=True)
    chunks, tokens = data["kv"], data["tokens"]
    n_chunks, layers, two, chunk_tokens, heads, dim = chunks.shape
    if chunk_tokens != args.chunk_size:
        raise ValueError(
            f"{args.kv} holds {chunk_tokens}-token chunks; --chunk-size is {args.chunk_size}"
        )
    src = (
        chunks.permute(1, 2, 0, 3, 4, 5)
        .reshape(layers, 2, n_chunks * chunk_tokens, heads, dim)
        .contiguous()
    )
    return src, tokens, (n_chunks, chunk_tokens)


def _backend(args):
    """The disk backend's fresh folder, or a flushed Redis client: (disk_dir, redis_client)."""
    disk_dir = None
    if args.backend == "disk":
        if not args.disk_dir:
            raise ValueError("--backend disk needs --disk-dir")
        disk_dir = tempfile.mkdtemp(prefix="lmcache-disk-", dir=args.disk_dir)
    redis_client = None
    if args.backend == "redis":
        if not args.redis_url:
            raise ValueError("--backend redis needs --redis-url")
        import redis

        redis_client = redis.Redis.from_url(args.redis_url)
        redis_client.flushdb()
    return disk_dir, redis_client


def _roundtrips(args, engine, keys, src, tokens, redis_client) -> tuple:
    """``--warmup`` then ``--runs`` store + retrieve round trips, each after a clear: the timed
    seconds, whether the first came back exact, which backends served it."""
    import torch

    out = torch.empty_like(src)
    landed = None if args.backend == "cpu" else _landed_check(engine, keys, args, redis_client)
    put_s, get_s, exact, served_by = [], [], None, None
    for i in range(args.warmup + args.runs):
        _clear(engine, keys, args, redis_client)
        t0 = time.perf_counter()
        engine.store(tokens, kvcaches=src)
        if landed is not None:
            _wait_landed(landed)
        t1 = time.perf_counter()
        if engine.lookup(tokens) != len(tokens):
            raise RuntimeError("LMCache did not store every chunk")
        out.zero_()
        t2 = time.perf_counter()
        mask = engine.retrieve(tokens, kvcaches=out)
        t3 = time.perf_counter()
        if int(mask.sum()) != len(tokens):
            raise RuntimeError(f"LMCache retrieved {int(mask.sum())} of {len(tokens)} tokens")
        if exact is None:
            exact = bool(torch.equal(out, src))
            served_by = _served_by(engine, tokens)
        if i >= args.warmup:
            put_s.append(t1 - t0)
            get_s.append(t3 - t2)
    return put_s, get_s, exact, served_by


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    src, tokens, (n_chunks, chunk_tokens) = _source(args)
    args._tokens = tokens
    nbytes = src.numel() * src.element_size()
    disk_dir, redis_client = _backend(args)
    name, engine = _build_engine(args, src.shape, src.dtype, disk_dir)
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
    try:
        put_s, get_s, exact, served_by = _roundtrips(args, engine, keys, src, tokens, redis_client)
    finally:
        clean_close = _destroy(LMCacheEngineBuilder, name)
        if redis_client is not None:
            redis_client.flushdb()
            redis_client.close()
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    put_mbs = [nbytes / 1e6 / t for t in put_s]
    get_mbs = [nbytes / 1e6 / t for t in get_s]
    import lmcache

    return {
        "system": "lmcache",
        "version": getattr(lmcache, "__version__", "0.5.6"),
        "torch": torch.__version__,
        "backend": args.backend,
        "chunks": n_chunks,
        "chunk_tokens": chunk_tokens,
        "kv_bytes": nbytes,
        "roundtrip_exact": exact,
        "served_by": served_by,
        "clean_close": clean_close,
        "put_s": put_s,
        "get_s": get_s,
        "put_mbs": put_mbs,
        "get_mbs": get_mbs,
        "put_mbs_median": statistics.median(put_mbs),
        "get_mbs_median": statistics.median(get_mbs),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a stuck run is
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    # LMCache (and the libraries it pulls) may print; keep stdout for the one JSON object.
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        result = run(args)
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    # LMCache leaves non-daemon threads behind (and a hung close for Redis): do not wait for them.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
