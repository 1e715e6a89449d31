"""Storage-tier throughput: kvfuse's memory, disk and Redis tiers vs raw file I/O and LMCache 0.5.6.

What is measured, on real KV (SmolLM2-135M prefill of MuSiQue documents, fp16, 256-token chunks of
30 x 2 x 256 x 3 x 64 x 2 B = 5.9 MB), all chunks of the prompt in one batch; MB/s = KV tensor
bytes / 1e6 / seconds (headers not counted).

Repetitions: the whole comparison (every kvfuse row, the raw files, every LMCache backend) runs
``--reps`` times (default 5), interleaved: each repetition measures everything once, in an order
rotated from one repetition to the next, so a slow minute of a shared machine hits every side.
Within a repetition a cell is the median of ``--runs`` runs after ``--warmup`` untimed ones. The
table prints each cell as median (min-max) over the repetitions, and the ratios (kvfuse / LMCache,
disk / raw files) are taken within each repetition, then summarised the same way: a target passes
on the median of the repetitions' ratios, and the min-max shows how far one lucky or unlucky
repetition strays.

What each row measures:

- kvfuse put = ``encode_entry`` (raw codec: the payload is not copied) + the tier's synchronous
  ``put_many`` (for the disk and Redis tiers their own put, not the TieredStore's background
  queue), from chunks already copied out of the KV; kvfuse get = the tier's reads as
  ``TieredStore.fetch`` does them and the one validation (header and per-layer checksums, once
  per serialized entry: Redis, one ``get_many`` then ``open_entry``; disk, each file read through
  ``read_entry``, which checks every few layers right after reading them) + decoding to
  KVChunks. These are compared with raw file I/O;
- kvfuse put from KV / get into KV = the same plus the copy of each chunk out of the prompt's KV
  tensor before the put (the engine's ``KVCache.chunk``) and into a destination KV tensor after
  the get (the engine's ``append_chunk``): the whole path, as LMCache's ``store`` / ``retrieve``
  copy from and into the KV they are given. These are compared with LMCache;
- raw file = the same bytes, one file per chunk, ``open(p, "wb").write`` / ``readinto`` a
  preallocated buffer, in the same file system; no fsync on either side; both sides' files are
  deleted before each put run and read back from the page cache, and raw / kvfuse-disk runs alternate
  so both see the same machine load;
- LMCache = ``bench/lmcache_baseline.py`` run by the LMCache venv's python on the same tensors
  (CPU, local disk and Redis backends; see that file for how each is made comparable).

Every kvfuse and LMCache path is checked bit-exact once. A ``redis-server`` is started on a free
127.0.0.1 port (``--save "" --appendonly no``) and stopped by its PID at the end. Results go to
``docs/bench/store.json`` and ``docs/bench/store.png`` (matplotlib: ``pip install matplotlib``).

    python bench/store.py                 # full run (5 runs)
    python bench/store.py --quick         # smoke run (2 runs)
    python bench/store.py --signing       # signed vs unsigned entries (cache.signing_key), disk and Redis
    python bench/store.py --encrypt       # encrypted vs plaintext entries (cache.encryption_key_file), disk

``--signing`` measures the cost of signed entries instead of the comparison above: the disk and
Redis tiers' put (``encode_entry``, then ``Entry.signed``: BLAKE3 of every layer and the HMAC,
what the store's background writer adds with a key) and get (the same reads, checked with the
signer: the tag, then every layer against its BLAKE3 digest instead of its xxh3 checksum), each
signed and unsigned in the same repetition, alternating which goes first; ``--reps`` repetitions
(default 5), each cell the median of ``--runs`` runs. The ratio signed / unsigned is taken within
each repetition and reported as its median (min-max). The memory tier is not measured: it holds
in-process entries, never signed or checked. Results go to ``docs/bench/store_signing.json``
(only from a full run: the default --reps, --runs and --tokens).

``--encrypt`` measures the cost of encrypted entries the same way, on the disk tier only: a
``DiskTier`` against an ``EncryptedTier`` over one (AES-256-GCM of the whole entry on put; on get
the whole file read and opened, then checked by ``open_entry``: encryption turns off the disk
tier's streamed reads). Results are printed, and written to ``docs/bench/store_encrypt.json``
from a full run only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import add_common
from bench.lib.paths import DATA, MUSIQUE_DEV, OUT, REPO
from bench.lib.results import environment, print_table, write_json
from bench.lib.rounds import order
from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.encryption import BlobCipher
from kvfuse.kv.format import decode_chunk, encode_chunk, encode_entry, open_entry, read_entry
from kvfuse.kv.keys import Namespace, layout_of, prefix_keys
from kvfuse.kv.signing import EntrySigner
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier, RedisTier
from kvfuse.tiers.encrypted import EncryptedTier
from kvfuse_testkit import LocalRedis

ROWS = ("memory", "memory (TieredStore)", "disk", "redis")
LMCACHE_OF = {"memory": "cpu", "memory (TieredStore)": "cpu", "disk": "disk", "redis": "redis"}
GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common(p, ("model", {"help": "built-in model whose KV is stored (default smollm2)"}))
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="prompt tokens; a multiple of --chunk-tokens (default 4096)",
    )
    p.add_argument(
        "--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256, as LMCache)"
    )
    p.add_argument(
        "--data",
        default=str(DATA / "musique_s.json"),
        help="MuSiQue file (default ../shared/data/musique_s.json from the repo root, or $KVFUSE_DATA)",
    )
    p.add_argument(
        "--example",
        type=int,
        default=0,
        help="first example whose documents make the text (default 0; 0-49 = dev split)",
    )
    p.add_argument(
        "--kv-file",
        help="cache of the prefilled KV: loaded if it exists, else written (skips the "
        "~35 s model load + prefill on reruns)",
    )
    _run_flags(p)
    _baseline_flags(p)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.reps = 2, 2
    if args.tokens <= 0 or args.tokens % args.chunk_tokens:
        p.error(f"--tokens must be a positive multiple of --chunk-tokens ({args.chunk_tokens})")
    if args.runs < 1 or args.warmup < 0 or args.reps < 1:
        p.error("--runs and --reps must be >= 1 and --warmup >= 0")
    return args


def _run_flags(p: argparse.ArgumentParser) -> None:
    add_common(p, ("runs", {"help": "timed runs per measurement (default 5)"}))
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument(
        "--reps",
        type=int,
        default=5,
        help="repetitions of the whole comparison, interleaved (default 5)",
    )
    add_common(p, ("quick", {"help": "smoke mode: 2 runs, 2 repetitions"}))
    p.add_argument(
        "--signing",
        action="store_true",
        help="measure signed vs unsigned entries on the disk and Redis tiers instead (see above)",
    )
    p.add_argument(
        "--encrypt",
        action="store_true",
        help="measure encrypted vs plaintext entries on the disk tier instead (see above)",
    )
    p.add_argument(
        "--signing-json",
        default=str(OUT / "store_signing.json"),
        help="--signing results (default docs/bench/store_signing.json; written by a full run only)",
    )


def _baseline_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        default=tempfile.gettempdir(),
        help="where the disk tier, raw files and LMCache's disk backend write (default: system temp)",
    )
    p.add_argument(
        "--redis-server",
        default=shutil.which("redis-server") or "redis-server",
        help="redis-server executable (default: from PATH)",
    )
    p.add_argument(
        "--lmcache-python",
        default=str(Path(__file__).resolve().parent.parent / ".baselines/lmcache-venv/bin/python"),
        help="python of the LMCache venv (bench/setup_lmcache.sh); skipped with a note if missing",
    )
    p.add_argument("--no-lmcache", action="store_true", help="skip the LMCache baseline")
    p.add_argument(
        "--lmcache-torch-threads",
        type=int,
        default=1,
        help="torch threads of the LMCache process, for its connector copies (default 1)",
    )
    p.add_argument(
        "--out-json",
        default=str(OUT / "store.json"),
        help="results (default docs/bench/store.json)",
    )
    p.add_argument(
        "--out-png", default=str(OUT / "store.png"), help="bar chart (default docs/bench/store.png)"
    )


# -- the KV under test ----------------------------------------------------------------------------


def _prompt_tokens(args, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of the documents of consecutive examples from ``--example`` on, and the examples used."""
    examples = json.loads(Path(args.data).read_text())
    ids, used = [], []
    for i in range(args.example, len(examples)):
        text = "\n\n".join(ctx["text"] for ctx in examples[i]["ctxs"])
        ids += tokenizer.encode(text, add_special_tokens=not ids)
        used.append(i)
        if len(ids) >= args.tokens:
            return ids[: args.tokens], used
    raise ValueError(
        f"examples {args.example}.. of {args.data} give only {len(ids)} tokens; lower --tokens"
    )


def build_kv(args) -> dict:
    """Prefill the prompt once (or load ``--kv-file``); the chunks, their tokens and identity."""
    if args.kv_file and Path(args.kv_file).is_file():
        kv = torch.load(args.kv_file, weights_only=True)
        print(f"KV loaded from {args.kv_file}")
    else:
        from kvfuse.models import load_model

        t0 = time.perf_counter()
        model = load_model(args.model)
        tokens, used = _prompt_tokens(args, model.tokenizer)
        cache = model.runner.new_cache(args.tokens, dtype=torch.float16)
        model.runner.forward(tokens, cache, logits="none")
        chunks = [
            cache.chunk(s, s + args.chunk_tokens) for s in range(0, args.tokens, args.chunk_tokens)
        ]
        c = model.config
        kv = {
            "kv": torch.stack([ch.kv for ch in chunks]),
            "positions": torch.stack([ch.positions for ch in chunks]),
            "tokens": torch.tensor(tokens, dtype=torch.int64),
            "examples": torch.tensor(used),
            "fingerprint": model.fingerprint,
            "layout": layout_of(c.num_layers, c.num_kv_heads, c.head_dim),
            "model": args.model,
        }
        print(f"prefilled {args.tokens} tokens of {args.model} in {time.perf_counter() - t0:.1f}s")
        if args.kv_file:
            torch.save(kv, args.kv_file)
    examples = [int(i) for i in kv["examples"]]
    split = "dev" if all(i in MUSIQUE_DEV for i in examples) else "TEST"
    print(f"data: {args.data} examples {examples} ({split} split), {len(kv['tokens'])} tokens")
    chunks = [KVChunk(kv=k, positions=p) for k, p in zip(kv["kv"], kv["positions"])]
    ns = Namespace(model_fingerprint=kv["fingerprint"], kv_dtype="float16", kv_layout=kv["layout"])
    keys = prefix_keys(kv["tokens"], args.chunk_tokens, ns)
    return {
        **kv,
        "chunks": chunks,
        "keys": keys,
        "split": split,
        "examples": examples,
        "full": torch.cat([ch.kv for ch in chunks], dim=2),
        "chunk_tokens": args.chunk_tokens,
        "dest": torch.empty_like(torch.cat([ch.kv for ch in chunks], dim=2)),
        "nbytes": sum(ch.nbytes for ch in chunks),
    }


# -- timing ---------------------------------------------------------------------------------------


def _timed(fn):
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _mbs(nbytes: int, seconds: list[float]) -> list[float]:
    return [nbytes / 1e6 / s for s in seconds]


def _summary(nbytes: int, put_s: list[float], get_s: list[float], **extra) -> dict:
    put, get = _mbs(nbytes, put_s), _mbs(nbytes, get_s)
    return {
        "put_s": put_s,
        "get_s": get_s,
        "put_mbs": put,
        "get_mbs": get,
        "put_mbs_median": statistics.median(put),
        "get_mbs_median": statistics.median(get),
        **extra,
    }


# -- kvfuse tiers ---------------------------------------------------------------------------------


class KvfuseCase:
    """One row: how to put, get (to KVChunks) and clear for one tier or the store."""

    def __init__(self, name: str, put, get, clear, close=lambda: None):
        self.name, self.put, self.get, self.clear, self.close = name, put, get, clear, close


def _copy_out(kv: dict) -> list[KVChunk]:
    """Each chunk copied out of the whole prompt's KV (the engine's ``KVCache.chunk``, LMCache's
    copy in ``store``): what a put then owns."""
    full, size = kv["full"], kv["chunk_tokens"]
    return [
        KVChunk(kv=full[:, :, i * size : (i + 1) * size].contiguous(), positions=ch.positions)
        for i, ch in enumerate(kv["chunks"])
    ]


def _copy_in(chunks: list[KVChunk], kv: dict) -> None:
    """Decoded chunks copied into a destination KV (the engine's ``append_chunk``, LMCache's retrieve)."""
    dest, size = kv["dest"], kv["chunk_tokens"]
    for i, ch in enumerate(chunks):
        dest[:, :, i * size : (i + 1) * size].copy_(ch.kv)


def _encode_all(
    keys: list, chunks: list[KVChunk], codec, signer: EntrySigner | None = None
) -> list[tuple]:
    """Entries of ``chunks``; signed with ``signer`` if given (what the store writes below memory)."""
    entries = [(k, encode_entry(ch, k, codec)) for k, ch in zip(keys, chunks)]
    return entries if signer is None else [(k, e.signed(signer)) for k, e in entries]


def _decode_all(keys: list, values, signer: EntrySigner | None = None) -> list[KVChunk]:
    """KVChunks of what a tier or the store returned: serialized blobs go through ``open_entry``
    (the store's one validation path, as ``TieredStore.fetch`` does), entries are decoded as they are."""
    if any(v is None for v in values):
        raise RuntimeError(
            f"{sum(v is None for v in values)} of {len(values)} chunks missing on get (tier error?)"
        )
    return [open_entry(v, k, signer=signer).chunk() for k, v in zip(keys, values)]


def _get_checked(tier, keys: list, signer: EntrySigner | None = None) -> list[KVChunk]:
    """A batch read from ``tier`` as ``TieredStore.fetch`` reads it: one ``get_many`` for a tier
    with batched reads (Redis), else key by key; the disk tier streams each entry through
    ``read_entry``, which checks every piece of it right after reading it. ``signer``: checked
    with it, as the store checks with ``cache.signing_key``."""
    if tier.batch_reads:
        return _decode_all(keys, tier.get_many(keys), signer)
    if tier.streams_reads:
        got = [
            tier.read_with(
                k, lambda readinto, size, k=k: read_entry(readinto, size, k, signer=signer)
            )
            for k in keys
        ]
        return _decode_all(keys, got)
    return [_decode_all([k], [tier.get(k)], signer)[0] for k in keys]


def tier_case(name: str, tier, kv: dict, codec, signer: EntrySigner | None = None) -> KvfuseCase:
    keys = kv["keys"]
    return KvfuseCase(
        name,
        put=lambda chunks: tier.put_many(_encode_all(keys, chunks, codec, signer)),
        get=lambda: _get_checked(tier, keys, signer),
        clear=tier.clear,
        close=tier.close,
    )


def store_case(name: str, store: TieredStore, kv: dict, codec) -> KvfuseCase:
    keys = kv["keys"]
    return KvfuseCase(
        name,
        put=lambda chunks: store.put(_encode_all(keys, chunks, codec)),
        get=lambda: [e.chunk() for e in store.get(keys)],  # store.get validated them
        clear=store.clear,
        close=store.close,
    )


def _check_exact(case_name: str, got: list[KVChunk], kv: dict) -> bool:
    ok = all(
        torch.equal(g.kv, c.kv) and torch.equal(g.positions, c.positions)
        for g, c in zip(got, kv["chunks"])
    )
    if not ok:
        print(f"  !! {case_name}: the round trip is NOT bit-exact")
    return ok


def run_case(case: KvfuseCase, kv: dict, i: int, times: dict[str, list], state: dict) -> None:
    """One put + get of all chunks, with the copies out of and into the KV timed apart; appended to
    ``times`` unless ``i`` is a warm-up run."""
    case.clear()
    t_out, own = _timed(lambda: _copy_out(kv))
    tp, _ = _timed(functools.partial(case.put, own))
    del own
    tg, got = _timed(case.get)
    t_in, _ = _timed(functools.partial(_copy_in, got, kv))
    if "exact" not in state:
        state["exact"] = _check_exact(case.name, got, kv) and torch.equal(kv["dest"], kv["full"])
    del got
    if i >= 0:
        for name, t in (("put", tp), ("get", tg), ("put_kv", t_out + tp), ("get_kv", tg + t_in)):
            times[name].append(t)


def measure_kvfuse(cases: list[KvfuseCase], raw: RawFiles, kv: dict, args, res: dict) -> None:
    """Every kvfuse row into ``res["kvfuse"]``; the raw files alternate with the disk tier's runs
    (same machine load, same page-cache state) into ``res["raw_file"]``."""
    nbytes = kv["nbytes"]
    for case in cases:
        times, raw_put, raw_get, state = (
            {"put": [], "get": [], "put_kv": [], "get_kv": []},
            [],
            [],
            {},
        )
        for i in range(-args.warmup, args.runs):
            if case.name == "disk":
                raw.clear()
                tp, _ = _timed(raw.put)
                tg, _ = _timed(raw.get)
                if i >= 0:
                    raw_put.append(tp)
                    raw_get.append(tg)
            run_case(case, kv, i, times, state)
        case.clear()
        kv_path = _summary(nbytes, times["put_kv"], times["get_kv"])
        r = res["kvfuse"][case.name] = _summary(
            nbytes,
            times["put"],
            times["get"],
            roundtrip_exact=state["exact"],
            **{
                f"{k}_kv_{unit}": v
                for k, unit in (
                    ("put", "s"),
                    ("get", "s"),
                    ("put", "mbs"),
                    ("get", "mbs"),
                    ("put", "mbs_median"),
                    ("get", "mbs_median"),
                )
                for v in [kv_path[f"{k}_{unit}"]]
            },
        )
        print(
            f"  kvfuse {case.name}: put {r['put_mbs_median']:.0f} MB/s, get {r['get_mbs_median']:.0f} MB/s; "
            f"from/into the KV: put {r['put_kv_mbs_median']:.0f}, get {r['get_kv_mbs_median']:.0f} MB/s; "
            f"exact={r['roundtrip_exact']}"
        )
        if case.name == "disk":
            r = res["raw_file"] = _summary(nbytes, raw_put, raw_get)
            raw.clear()
            print(
                f"  raw file: put {r['put_mbs_median']:.0f} MB/s, get {r['get_mbs_median']:.0f} MB/s"
            )


# -- raw files ------------------------------------------------------------------------------------


class RawFiles:
    """The floor: the same bytes, one plain file per chunk, no header, no checksum, no rename."""

    def __init__(self, root: Path, kv: dict):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.views = [
            memoryview(ch.kv.reshape(-1).view(torch.uint8).numpy()) for ch in kv["chunks"]
        ]
        self.paths = [root / f"{i:04d}.bin" for i in range(len(self.views))]
        self.buffers = [bytearray(len(v)) for v in self.views]  # preallocated (and touched) once

    def clear(self) -> None:
        for p in self.paths:
            p.unlink(missing_ok=True)

    def put(self) -> None:
        for p, v in zip(self.paths, self.views):
            with open(p, "wb") as f:
                f.write(v)

    def get(self) -> list[bytearray]:
        for p, b in zip(self.paths, self.buffers):
            with open(p, "rb", buffering=0) as f:
                if f.readinto(b) != len(b):
                    raise RuntimeError(f"short read of {p}")
        return self.buffers


# -- LMCache --------------------------------------------------------------------------------------


def run_lmcache(args, kv_file: Path, backend: str, workdir: Path, redis_url: str) -> dict | None:
    cmd = [
        args.lmcache_python,
        str(REPO / "bench" / "lmcache_baseline.py"),
        "--kv",
        str(kv_file),
        "--backend",
        backend,
        "--disk-dir",
        str(workdir),
        "--redis-url",
        redis_url,
        "--chunk-size",
        str(args.chunk_tokens),
        "--runs",
        str(args.runs),
        "--warmup",
        str(args.warmup),
        "--torch-threads",
        str(args.lmcache_torch_threads),
    ]
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "WARNING", "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not proc.stdout.strip():
        print(f"  !! LMCache {backend} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"  LMCache {backend}: put {result['put_mbs_median']:.0f} MB/s, get {result['get_mbs_median']:.0f} MB/s, "
        f"exact={result['roundtrip_exact']}, served by {result['served_by']} ({time.perf_counter() - t0:.0f}s)"
    )
    return result


# -- where the time goes -------------------------------------------------------------------------


def breakdown(kv: dict, codec, workdir: Path, runs: int) -> dict:
    """Milliseconds per batch (all chunks) of the pieces of the kvfuse paths, median of ``runs``:
    hashing, copies into fresh vs reused memory, reads into fresh vs reused buffers."""
    root = workdir / "breakdown"
    root.mkdir()
    pieces, n_blobs = breakdown_pieces(kv, codec, root)
    out = {}
    for name, fn in pieces.items():
        times = []
        for _ in range(runs + 1):
            t, keep = _timed(fn)
            del keep
            times.append(t * 1e3)
        out[name] = round(statistics.median(times[1:]), 2)
    shutil.rmtree(root)
    print(
        f"\nbreakdown, ms per batch of {n_blobs} chunks ({kv['nbytes'] / 1e6:.0f} MB), median of {runs}:"
    )
    for name, ms in out.items():
        print(f"  {ms:8.1f} ms  {kv['nbytes'] / 1e3 / ms:7.0f} MB/s  {name}")
    return out


def breakdown_pieces(kv: dict, codec, root: Path) -> tuple[dict, int]:
    """The pieces ``breakdown`` times, each a callable over the whole batch; the chunk count."""
    import numpy as np
    import xxhash

    from kvfuse.kv.format import verify

    keys, chunks = kv["keys"], kv["chunks"]
    views = [memoryview(c.kv.reshape(-1).view(torch.uint8).numpy()) for c in chunks]
    blobs = [encode_chunk(c, k, codec) for c, k in zip(chunks, keys)]
    reused = [np.empty(len(b), np.uint8) for b in blobs]
    for r in reused:
        r.fill(0)
    paths = [root / f"{i}.kvf" for i in range(len(blobs))]
    for p, b in zip(paths, blobs):
        p.write_bytes(b)

    def copy_reused():
        for r, v in zip(reused, views):
            r[: len(v)] = v

    def read(alloc):
        out = []
        for i, p in enumerate(paths):
            buf = alloc(i)
            with open(p, "rb", buffering=0) as f:
                f.readinto(buf)
            out.append(buf)
        return out

    return {
        "xxh3_64 of the payloads": lambda: [xxhash.xxh3_64_intdigest(v) for v in views],
        "copy payloads into fresh bytes": lambda: [bytes(v) for v in views],
        "copy payloads into reused buffers": copy_reused,
        "encode_chunk (hash + header + join)": lambda: [
            encode_chunk(c, k, codec) for c, k in zip(chunks, keys)
        ],
        "verify (header + per-layer checksums)": lambda: [
            verify(b, k) for b, k in zip(blobs, keys)
        ],
        "decode_chunk(bytes): checked, decoded": lambda: [
            decode_chunk(b, k) for b, k in zip(blobs, keys)
        ],
        "readinto fresh np.empty (as DiskTier.get)": lambda: read(
            lambda i: np.empty(len(blobs[i]), np.uint8)
        ),
        "readinto reused buffers (as raw file)": lambda: read(lambda i: reused[i]),
    }, len(blobs)


# -- the report -----------------------------------------------------------------------------------


def _mmm(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


FIELDS = ("put_mbs", "get_mbs", "put_kv_mbs", "get_kv_mbs")


def aggregate(reps: list[dict]) -> dict:
    """The repetitions' cells (each the median of its runs) as median / min / max, and the ratios
    taken within each repetition: kvfuse from/into the KV vs the matching LMCache backend, the disk
    tier vs the raw files."""

    def cells(results: list[dict]) -> dict:
        out = {"reps": results}
        for f in FIELDS:
            xs = [r[f"{f}_median"] for r in results if f"{f}_median" in r]
            if xs:
                out[f] = _mmm(xs)
                out[f"{f}_median"] = out[f]["median"]  # the plot's and older readers' field
        if all("roundtrip_exact" in r for r in results):
            out["roundtrip_exact"] = all(r["roundtrip_exact"] for r in results)
        return out

    res = {
        "kvfuse": {row: cells([r["kvfuse"][row] for r in reps]) for row in ROWS},
        "raw_file": cells([r["raw_file"] for r in reps]),
        "lmcache": {},
        "ratios": {},
    }
    for backend in ("cpu", "disk", "redis"):
        got = [r["lmcache"][backend] for r in reps if r["lmcache"].get(backend)]
        if got:
            res["lmcache"][backend] = cells(got)
            res["lmcache"][backend]["served_by"] = got[-1].get("served_by")
    for op in ("put", "get"):
        res["ratios"][f"disk {op} / raw file {op}"] = _mmm(
            [
                r["kvfuse"]["disk"][f"{op}_mbs_median"] / r["raw_file"][f"{op}_mbs_median"]
                for r in reps
            ]
        )
        for row in ROWS:
            backend = LMCACHE_OF[row]
            pairs = [
                (r["kvfuse"][row][f"{op}_kv_mbs_median"], r["lmcache"][backend][f"{op}_mbs_median"])
                for r in reps
                if r["lmcache"].get(backend)
            ]
            if pairs:
                res["ratios"][f"{row} {op} from/into the KV / LMCache {backend} {op}"] = _mmm(
                    [a / b for a, b in pairs]
                )
    return res


def targets(res: dict) -> list[dict]:
    """Each target on the median of the repetitions' ratios (issue 15: every tier's put and get at
    least LMCache's, the disk tier at least 70% of raw file I/O)."""
    out = []
    for name, stats in res["ratios"].items():
        needed = 0.7 if "raw file" in name else 1.0
        out.append(
            {
                "target": f"{name} >= {needed}",
                "status": "PASS" if stats["median"] >= needed else "FAIL",
                "ratio": round(stats["median"], 3),
                "min": round(stats["min"], 3),
                "max": round(stats["max"], 3),
                "needed": needed,
            }
        )
    for row in ROWS:
        backend = LMCACHE_OF[row]
        if backend not in res["lmcache"]:
            out.append(
                {
                    "target": f"{row} vs LMCache {backend}",
                    "status": "SKIP",
                    "ratio": None,
                    "needed": 1.0,
                }
            )
    return out


def _cell(cell) -> str:
    if cell is None:
        return "-"
    return f"{cell['median']:,.0f} ({cell['min']:,.0f}-{cell['max']:,.0f})"


def _ratio(res: dict, name: str) -> str:
    st = res["ratios"].get(name)
    return "-" if st is None else f"{st['median']:.2f} ({st['min']:.2f}-{st['max']:.2f})"


REPORT_HEADERS = [
    "tier",
    "put",
    "get",
    "raw put",
    "raw get",
    "put/raw",
    "get/raw",
    "put from KV",
    "get into KV",
    "LMCache put",
    "LMCache get",
    "put/LMC",
    "get/LMC",
]


def report_row(res: dict, row: str) -> list:
    f = _cell
    k, lm = res["kvfuse"][row], res["lmcache"].get(LMCACHE_OF[row])
    raw = res["raw_file"] if row == "disk" else None
    b = LMCACHE_OF[row]
    return [
        f"{row} ~ LMCache {b}",
        f(k["put_mbs"]),
        f(k["get_mbs"]),
        f(raw["put_mbs"]) if raw else "",
        f(raw["get_mbs"]) if raw else "",
        _ratio(res, "disk put / raw file put") if raw else "",
        _ratio(res, "disk get / raw file get") if raw else "",
        f(k["put_kv_mbs"]),
        f(k["get_kv_mbs"]),
        f(lm["put_mbs"]) if lm else "-",
        f(lm["get_mbs"]) if lm else "-",
        _ratio(res, f"{row} put from/into the KV / LMCache {b} put"),
        _ratio(res, f"{row} get from/into the KV / LMCache {b} get"),
    ]


def report(res: dict) -> None:
    n = len(res["kvfuse"]["disk"]["reps"])
    print(
        f"\nthroughput, MB/s (1 MB = 1e6 bytes of KV): median (min-max) over {n} interleaved repetitions, each "
        f"the median of {res['config']['runs']} runs; tier put/get vs raw files; put from / get into the KV vs "
        "LMCache store / retrieve; ratios taken within each repetition"
    )
    print_table(REPORT_HEADERS, [report_row(res, row) for row in ROWS])
    print("\ntargets (median of the repetitions' ratios; min-max):")
    for t in res["targets"]:
        if t["ratio"] is None:
            print(f"  {t['status']:4}  {t['target']}")
        else:
            print(f"  {t['status']:4}  {t['target']}: {t['ratio']} ({t['min']}-{t['max']})")


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib missing (pip install matplotlib): {path} not written")
        return
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    series = [
        ("kvfuse tier", "tab:cyan"),
        ("kvfuse from/into KV", "tab:blue"),
        ("raw file", "tab:gray"),
        ("LMCache 0.5.6", "tab:orange"),
    ]
    x = np.arange(len(ROWS))
    for ax, op in zip(axes, ("put", "get")):
        for j, (label, color) in enumerate(series):
            vals, lo, hi = [], [], []
            for row in ROWS:
                src, field = {
                    "kvfuse tier": (res["kvfuse"][row], f"{op}_mbs_median"),
                    "kvfuse from/into KV": (res["kvfuse"][row], f"{op}_kv_mbs_median"),
                    "raw file": (res["raw_file"] if row == "disk" else None, f"{op}_mbs_median"),
                    "LMCache 0.5.6": (res["lmcache"].get(LMCACHE_OF[row]), f"{op}_mbs_median"),
                }[label]
                cell = src.get(field.removesuffix("_median")) if src else None
                vals.append(cell["median"] if cell else 0)
                lo.append(cell["median"] - cell["min"] if cell else 0)
                hi.append(cell["max"] - cell["median"] if cell else 0)
            ax.bar(
                x + (j - 1.5) * 0.2, vals, 0.2, label=label, color=color, yerr=[lo, hi], capsize=2
            )
        ax.set_xticks(x, [r.replace(" (", "\n(") for r in ROWS])
        ax.set_yscale("log")
        ax.set_title(f"{op} (256-token fp16 chunks, {res['data']['chunks']} per batch)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("MB/s (median and min-max of the repetitions, log scale)")
    axes[0].legend()
    fig.suptitle(
        f"kvfuse storage tiers vs raw file I/O and LMCache ({res['env']['cpu_count']} CPUs, "
        f"{res['env']['date'][:10]})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -- signed entries -------------------------------------------------------------------------------


def measure_signing(kv: dict, args, workdir: Path, redis_url: str) -> dict:
    """Signed vs unsigned put / get of the disk and Redis tiers, ``--reps`` interleaved repetitions
    (see the module docstring); per tier and mode, the repetitions' cells."""
    codec, signer = get_codec("raw"), EntrySigner([os.urandom(32)])
    tiers = {
        "disk": DiskTier(workdir / "signing-disk", 4 * kv["nbytes"] + GIB),
        "redis": RedisTier(redis_url, timeout_s=10.0),
    }
    cells: dict[str, dict[str, list]] = {name: {"unsigned": [], "signed": []} for name in tiers}
    try:
        for rep in range(args.reps):
            modes = order(["unsigned", "signed"], rep, alternate=True)
            print(f"\nrepetition {rep + 1} of {args.reps} (load average {os.getloadavg()[0]:.2f})")
            for name, tier in tiers.items():
                for mode in modes:
                    case = tier_case(name, tier, kv, codec, signer if mode == "signed" else None)
                    times, state = {"put": [], "get": [], "put_kv": [], "get_kv": []}, {}
                    for i in range(-args.warmup, args.runs):
                        run_case(case, kv, i, times, state)
                    case.clear()
                    r = _summary(
                        kv["nbytes"], times["put"], times["get"], roundtrip_exact=state["exact"]
                    )
                    cells[name][mode].append(r)
                    print(
                        f"  {name} {mode}: put {r['put_mbs_median']:.0f} MB/s, get {r['get_mbs_median']:.0f} MB/s"
                    )
    finally:
        for t in tiers.values():
            t.close()
    return cells


def signing_breakdown(kv: dict, runs: int) -> dict:
    """Milliseconds per batch of the CPU work alone, in memory, median of ``runs``: the header an
    unsigned put builds (xxh3 per layer) vs ``Entry.signed`` (BLAKE3 per layer, HMAC), and the
    check of a get: ``open_entry`` unsigned (xxh3) vs signed with the signer (HMAC, BLAKE3)."""
    codec, signer = get_codec("raw"), EntrySigner([os.urandom(32)])
    entries = _encode_all(kv["keys"], kv["chunks"], codec)
    plain = [bytearray(e.join()) for _, e in entries]
    signed = [bytearray(e.signed(signer).join()) for _, e in entries]
    pieces = {
        "unsigned header (xxh3)": lambda: [
            encode_entry(c, k, codec).header for k, c in zip(kv["keys"], kv["chunks"])
        ],
        "signed header (BLAKE3 + HMAC)": lambda: [e.signed(signer) for _, e in entries],
        "open_entry unsigned (xxh3)": lambda: [open_entry(b) for b in plain],
        "open_entry signed, checked (HMAC + BLAKE3)": lambda: [
            open_entry(b, signer=signer) for b in signed
        ],
    }
    out = {}
    for name, fn in pieces.items():
        out[name] = round(statistics.median(_timed(fn)[0] * 1e3 for _ in range(runs)), 2)
        print(f"  {out[name]:8.1f} ms  {kv['nbytes'] / 1e3 / out[name]:7.0f} MB/s  {name}")
    return out


def signing_summary(cells: dict, base: str = "unsigned", other: str = "signed") -> dict:
    """Per tier and operation: MB/s of mode ``base`` and ``other`` (median, min, max over the
    repetitions) and the time other / base taken within each repetition (1.10 = 10% slower)."""
    out = {}
    for name, modes in cells.items():
        for op in ("put", "get"):
            plain = [r[f"{op}_mbs_median"] for r in modes[base]]
            changed = [r[f"{op}_mbs_median"] for r in modes[other]]
            out[f"{name} {op}"] = {
                f"{base}_mbs": _mmm(plain),
                f"{other}_mbs": _mmm(changed),
                f"time_{other}_over_{base}": _mmm([a / b for a, b in zip(plain, changed)]),
            }
        out[f"{name} exact"] = all(r["roundtrip_exact"] for m in modes.values() for r in m)
    return out


def measure_encryption(kv: dict, args, workdir: Path) -> dict:
    """Plaintext vs encrypted put / get of the disk tier, ``--reps`` interleaved repetitions, the
    order alternating; the repetitions' cells per mode."""
    codec, cap = get_codec("raw"), 4 * kv["nbytes"] + GIB
    tiers = {
        "plaintext": DiskTier(workdir / "plain-disk", cap),
        "encrypted": EncryptedTier(
            DiskTier(workdir / "enc-disk", cap), BlobCipher([os.urandom(32)])
        ),
    }
    cells: dict[str, list] = {mode: [] for mode in tiers}
    try:
        for rep in range(args.reps):
            print(f"\nrepetition {rep + 1} of {args.reps} (load average {os.getloadavg()[0]:.2f})")
            for mode in order(list(tiers), rep, alternate=True):
                case = tier_case("disk", tiers[mode], kv, codec)
                times, state = {"put": [], "get": [], "put_kv": [], "get_kv": []}, {}
                for i in range(-args.warmup, args.runs):
                    run_case(case, kv, i, times, state)
                case.clear()
                r = _summary(
                    kv["nbytes"], times["put"], times["get"], roundtrip_exact=state["exact"]
                )
                cells[mode].append(r)
                print(
                    f"  disk {mode}: put {r['put_mbs_median']:.0f} MB/s, get {r['get_mbs_median']:.0f} MB/s"
                )
    finally:
        for t in tiers.values():
            t.close()
    return {"disk": cells}


def run_encryption(args, kv: dict, workdir: Path, redis) -> int:
    """``--encrypt``: encrypted vs plaintext entries on the disk tier."""
    redis.stop()  # not measured here
    try:
        summary = signing_summary(measure_encryption(kv, args, workdir), "plaintext", "encrypted")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\nencrypted vs plaintext entries, disk tier, MB/s of KV ({len(kv['chunks'])} chunks of "
        f"{kv['chunks'][0].nbytes / 1e6:.1f} MB): median (min-max) over {args.reps} repetitions, "
        f"each the median of {args.runs} runs"
    )
    rows = [
        [row, _cell(c["plaintext_mbs"]), _cell(c["encrypted_mbs"])]
        + ["{median:.2f} ({min:.2f}-{max:.2f})".format(**c["time_encrypted_over_plaintext"])]
        for row, c in summary.items()
        if not row.endswith("exact")
    ]
    print_table(["tier op", "plaintext", "encrypted", "time encrypted/plaintext"], rows)
    if (args.reps, args.runs, args.tokens) == (5, 5, 4096) and not args.quick:
        out = OUT / "store_encrypt.json"
        write_json(out, {"summary": summary, "env": environment()}, add_environment=False, indent=1)
        print(f"wrote {out}")
    else:
        print("(a reduced run: no JSON written)")
    return 0


def report_signing(summary: dict, cpu_ms: dict, args, kv: dict) -> None:
    rows = [
        [
            row,
            f"{c['unsigned_mbs']['median']:,.0f}",
            f"{c['signed_mbs']['median']:,.0f}",
            f"{c['time_signed_over_unsigned']['median']:.2f} ({c['time_signed_over_unsigned']['min']:.2f}-"
            f"{c['time_signed_over_unsigned']['max']:.2f})",
            "PASS" if c["time_signed_over_unsigned"]["median"] <= 1.1 else "FAIL",
        ]
        for row, c in summary.items()
        if not row.endswith("exact")
    ]
    print(
        f"\nsigned vs unsigned entries, MB/s of KV ({len(kv['chunks'])} chunks of {kv['chunks'][0].nbytes / 1e6:.1f} "
        f"MB): median over {args.reps} interleaved repetitions, each the median of {args.runs} runs; time ratio "
        f"signed / unsigned within each repetition, median (min-max); target <= 1.10"
    )
    print_table(["tier op", "unsigned", "signed", "time signed/unsigned", "<= 1.10"], rows)
    full = (args.reps, args.runs, args.tokens) == (5, 5, 4096) and not args.quick
    if full:
        out = write_json(
            Path(args.signing_json),
            {
                "summary": summary,
                "cpu_ms": cpu_ms,
                "env": {**environment(), "loadavg_end": os.getloadavg()},
                "config": {
                    "reps": args.reps,
                    "runs": args.runs,
                    "warmup": args.warmup,
                    "tokens": args.tokens,
                    "chunk_tokens": args.chunk_tokens,
                },
            },
            add_environment=False,
            indent=1,
        )
        print(f"wrote {out}")
    else:
        print("(a reduced run: no JSON written)")


# -- main -----------------------------------------------------------------------------------------


def run_signing(args, kv: dict, workdir: Path, redis) -> int:
    """``--signing``: signed vs unsigned entries on the disk and Redis tiers."""
    try:
        summary = signing_summary(measure_signing(kv, args, workdir, redis.url))
    finally:
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nCPU alone, ms per batch of {len(kv['chunks'])} chunks, median of {args.runs}:")
    report_signing(summary, signing_breakdown(kv, args.runs), args, kv)
    return 0


def lmcache_status(args) -> str | None:
    """Why the LMCache baseline is skipped, or None."""
    note = None
    if args.no_lmcache:
        note = "skipped (--no-lmcache)"
    elif not Path(args.lmcache_python).is_file():
        note = f"skipped: {args.lmcache_python} not found (run bench/setup_lmcache.sh)"
    if note:
        print(f"LMCache baseline {note}")
    return note


def repetitions(args, kv, cases, raw, workdir: Path, redis_url: str, note) -> list[dict]:
    """The whole comparison ``--reps`` times: kvfuse's cases in an order rotated every repetition
    and LMCache's backends likewise, LMCache first every other time, so slow minutes of the
    machine fall on every side."""
    kv_file = workdir / "kv.pt"
    if not note:
        torch.save(
            {"kv": torch.stack([c.kv for c in kv["chunks"]]), "tokens": kv["tokens"]}, kv_file
        )
    reps: list[dict] = []
    for rep in range(args.reps):
        print(f"\nrepetition {rep + 1} of {args.reps} (load average {os.getloadavg()[0]:.2f})")
        one: dict = {"kvfuse": {}, "lmcache": {}}
        cases_now = order(cases, rep, rotate=True)
        backends = [] if note else order(["cpu", "disk", "redis"], rep, rotate=True)

        def kvfuse_side():
            measure_kvfuse(cases_now, raw, kv, args, one)

        def lmcache_side():
            for backend in backends:
                result = run_lmcache(args, kv_file, backend, workdir, redis_url)
                if result:
                    one["lmcache"][backend] = result

        for side in order([kvfuse_side, lmcache_side], rep, alternate=True):
            side()
        reps.append(one)
    kv_file.unlink(missing_ok=True)
    return reps


def result_meta(args, kv: dict, load_start, note) -> dict:
    return dict(
        config={
            "reps": args.reps,
            "runs": args.runs,
            "warmup": args.warmup,
            "chunk_tokens": args.chunk_tokens,
            "dir": args.dir,
        },
        env={
            **environment(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "lmcache_python": args.lmcache_python,
            "lmcache_note": note,
        },
        data={
            "file": args.data,
            "examples": kv["examples"],
            "split": kv["split"],
            "model": kv["model"],
            "tokens": len(kv["tokens"]),
            "chunks": len(kv["chunks"]),
            "chunk_bytes": kv["chunks"][0].nbytes,
            "kv_bytes": kv["nbytes"],
            "shape": list(kv["chunks"][0].kv.shape),
            "dtype": "float16",
        },
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # What a kvfuse engine process does at start-up (kvfuse.runtime.open_engine): keep freed
    # multi-MB buffers for reuse instead of paying page faults on every new entry.
    from kvfuse.heap import tune as tune_allocator

    tune_allocator()
    load_start = os.getloadavg()
    kv = build_kv(args)
    nbytes, codec = kv["nbytes"], get_codec("raw")
    print(
        f"{len(kv['chunks'])} chunks x {kv['chunks'][0].nbytes / 1e6:.2f} MB = {nbytes / 1e6:.1f} MB of KV; "
        f"{args.reps} interleaved repetitions of {args.runs} runs after {args.warmup} warm-up"
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvfuse-bench-store-", dir=args.dir))
    redis = LocalRedis(args.redis_server).start()
    print(f"redis-server pid {redis.proc.pid} on 127.0.0.1:{redis.port}")
    if args.signing:
        return run_signing(args, kv, workdir, redis)
    if args.encrypt:
        return run_encryption(args, kv, workdir, redis)
    cases: list[KvfuseCase] = []
    try:
        cap = 4 * nbytes + GIB
        cases = [
            tier_case("memory", MemoryTier(cap), kv, codec),
            store_case("memory (TieredStore)", TieredStore(MemoryTier(cap)), kv, codec),
            tier_case("disk", DiskTier(workdir / "kvfuse-disk", cap), kv, codec),
            # timeout 10 s, not 0.5: a stall of the busy machine must not turn into a dropped write.
            tier_case("redis", RedisTier(redis.url, timeout_s=10.0), kv, codec),
        ]
        raw = RawFiles(workdir / "raw", kv)
        note = lmcache_status(args)
        reps = repetitions(args, kv, cases, raw, workdir, redis.url, note)
        breakdown_ms = breakdown(kv, codec, workdir, args.runs)
    finally:
        for case in cases:
            case.close()
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    res = aggregate(reps)
    res["breakdown_ms"] = breakdown_ms
    res.update(result_meta(args, kv, load_start, note))
    res["targets"] = targets(res)
    report(res)
    print(f"wrote {write_json(Path(args.out_json), res, add_environment=False, indent=1)}")
    plot(res, Path(args.out_png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
