"""Disk faults under a real ``kvfuse serve`` and concurrent ``openai`` clients: entries truncated,
bit-flipped and deleted under the running server, a really full disk (a small tmpfs), folders and
files it may not read (chmod 000, the server running as root without the capabilities that bypass
permissions), and the server killed (SIGKILL) in the middle of its writes, then restarted on the
same folder.

Every request must succeed with the greedy answer of a cache-free request (or differ first at a
near-tie, ``faults.Reference``); damaged entries are never used: removed and counted
(``unusable_entries``, the disk tier's ``errors``); failures are counted; after a restart the
temp files of the dead process are gone, the folder is within its capacity and the entries it
wrote are reused; and the tier serves hits again once the fault is gone.

The memory tier holds no whole chunk (every reuse is a disk read). The fast variants use 64-token
chunks (1.5 MB entries) and ~175-token prompts; the slow ones (``-m slow``) 256-token chunks
(5.9 MB), ~600-token prompts, more clients and repeated faults.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from faults import (
    NO_DAC,
    Load,
    PrefixedServer,
    Reference,
    can_drop_dac,
    chain_paths,
    chat_engine,
    check_outcomes,
    client_of,
    entry_files,
    entry_ok,
    flip_bit,
    hits_again,
    idle,
    jobs,
    kv_stats,
    metrics,
    record,
    remount,
    run_all,
    temp_files,
    tier,
    tmpfs,
    truncate,
    used_bytes,
    wait_until,
    warm_up,
)
from keyed import K
from kvfuse_helpers import load_builtin, model_home

from kvfuse.history.records import HistoryIndex
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.disk.files import stale_temp
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Shape:
    documents: int
    paragraphs: int  # ~100 tokens each
    chunk_size: int
    threads: int
    cycles: int
    per_phase: int
    full_disk: str  # the tmpfs: room for two or three entries
    capacity: str  # the disk tier's capacity in the kill test: a few entries
    max_tokens: int

    def jobs(self, documents: int | None = None, paragraphs: int | None = None):
        return jobs(
            documents or self.documents,
            1,
            paragraphs or self.paragraphs,
            max_tokens=self.max_tokens,
        )


FAST = Shape(
    documents=5,
    paragraphs=1,
    chunk_size=64,
    threads=3,
    cycles=1,
    per_phase=3,
    full_disk="3m",
    capacity="12MiB",
    max_tokens=4,
)
SLOW = Shape(
    documents=6,
    paragraphs=5,
    chunk_size=256,
    threads=4,
    cycles=3,
    per_phase=6,
    full_disk="20m",
    capacity="64MiB",
    max_tokens=8,
)
SHAPES = [pytest.param(FAST, id="fast"), pytest.param(SLOW, id="slow", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def model():
    ensure_model(model_home(), "smollm2")
    return load_builtin("smollm2")


def config(disk: Path, shape: Shape, **cache) -> dict:
    return {
        "model": "smollm2",
        "cache": {
            "disk_path": str(disk),
            "memory_bytes": "1MiB",
            "chunk_size": shape.chunk_size,
            **cache,
        },
    }


def serve(disk: Path, shape: Shape, cls=ServerProcess, **cache) -> ServerProcess:
    """A server on ``disk``; its log is kept beside the folder (``server-<n>.log``) for a failure."""
    n = len(list(disk.parent.glob("server-*.log")))
    return cls(
        model_home(), config=config(disk, shape, **cache), log_path=disk.parent / f"server-{n}.log"
    ).start()


def disk_counts(srv: ServerProcess) -> dict:
    s = kv_stats(srv)
    m = metrics(srv)
    return {
        **s["tiers"]["disk"],
        "unusable": s["tiers"]["store"]["unusable_entries"],
        "errors_in_metrics": m['kvfuse_tier_errors_total{tier="disk"}'],
        "unusable_in_metrics": m["kvfuse_store_unusable_entries_total"],
    }


def delta(after: dict, before: dict, *names: str) -> dict:
    return {n: after[n] - before[n] for n in names}


def label(name: str, shape: Shape) -> str:
    return f"{name}[{'slow' if shape is SLOW else 'fast'}]"


# ------------------------------------------------------------------------------ unit level
def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_temp_names():
    """The rule both start-up sweeps use (tiers/disk/files.py ``stale_temp``)."""
    dead, alive, now = dead_pid(), os.getpid(), time.time()
    assert stale_temp(f".{dead}.ab12.tmp", now, now, 600)  # its writer was killed
    assert not stale_temp(f".{alive}.ab12.tmp", now, now, 600)  # being written right now
    assert stale_temp(f".{alive}.ab12.tmp", now - 601, now, 600)  # a pid reused since
    assert not stale_temp(f".{dead}.ab12.rec", now, now, 600)  # not a temp file
    assert not stale_temp("ns_3Ap_3Aab.kvf", now - 10**6, now, 600)
    assert not stale_temp(f".{dead}.xyz.tmp", now, now, 600)  # not a name the writers make


def test_an_unreadable_fan_out_folder_is_skipped_at_start_up_and_when_clearing(
    tmp_path, monkeypatch
):
    """The fix for what test_folders_and_files_the_server_may_not_read found (a server that did
    not start, and a DELETE /v1/kv that stopped at the first unreadable folder): here the EACCES is
    injected (this process is root); the server test produces it for real."""
    keys = [K(str(i)) for i in range(40)]
    tier = DiskTier(tmp_path, 1 << 30)
    for k in keys:
        tier.put(k, b"x" * 100)
    locked = Path(tier._path(keys[0])).parent
    real = os.scandir

    def scandir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    again = DiskTier(tmp_path, 1 << 30)  # used to raise PermissionError
    hidden = [k for k in keys if Path(tier._path(k)).parent == locked]
    assert again.entries() == len(keys) - len(hidden) and again.stats.errors == 1
    assert again.delete_prefix("") == len(keys) - len(hidden)  # used to stop at the locked folder
    assert again.stats.errors == 2
    monkeypatch.setattr(os, "scandir", real)
    assert sorted(map(str, DiskTier(tmp_path, 1 << 30).keys_lru())) == sorted(map(str, hidden))


def test_history_record_temp_files_of_dead_writers_are_removed_at_start_up(tmp_path):
    """The fix for what the kill test found: a record's temp file left by a killed writer stayed
    forever (the start-up load read ``*.rec`` only)."""
    index = HistoryIndex(path=tmp_path)
    ns = _namespace()
    assert index.add(ns.key_prefix(), list(range(100)), ns, ()) is not None
    written = [p.name for p in tmp_path.iterdir()]
    assert len(written) == 1 and written[0].endswith(".rec")
    dead, now = dead_pid(), time.time()
    (tmp_path / f".{dead}.{'a' * 24}.tmp").write_bytes(b"partial")  # killed mid-write
    (tmp_path / f".{os.getpid()}.{'b' * 24}.tmp").write_bytes(b"partial")  # a live writer's: kept
    old = tmp_path / f".{'c' * 24}.rec.tmp"  # the older naming, without a pid: only by age
    old.write_bytes(b"partial")
    os.utime(old, (now - 3600, now - 3600))
    young = tmp_path / f".{'d' * 24}.rec.tmp"
    young.write_bytes(b"partial")
    again = HistoryIndex(path=tmp_path)
    assert len(again) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [written[0], f".{os.getpid()}.{'b' * 24}.tmp", young.name]
    )


def test_a_damaged_chunk_under_a_stored_history_of_another_prompt_is_planned_around(
    model, tmp_path
):
    """The fix (now ``Prefiller.fetch``) for the 500 the kill test found (a KeyError while a plan's
    loads were executed): prompt P's first chunk is held but torn; the best stored history for P is another prompt's
    (Q shares P's first ~26 tokens), whose first entry lines up with those slots. Covered by P's
    chain, that entry was not read; once the torn chunk broke the chain, the new plan loaded it
    unread. Now every plan's entries are read (and checked) before anything is loaded."""
    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    p_job, q_job = jobs(3, 1, 1, max_tokens=4)[0], jobs(3, 1, 1, max_tokens=4)[2]
    ids = {j: chat_engine(model).prompts.encode_chat(j.body())[0] for j in (p_job, q_job)}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    store = TieredStore(MemoryTier(1), [DiskTier(tmp_path, 1 << 30)])  # every hit read from disk
    without_history = Engine(model, store, EngineSettings.of(chunk_size=64, history=False))
    engine = Engine(model, store, EngineSettings.of(chunk_size=64))
    try:
        without_history.generate(ids[p_job], params)  # P's chain, and no record of P
        without_history.flush()
        engine.generate(ids[q_job], params)  # Q's chain and its record
        engine.flush()
        first = chain_paths(model, p_job, 64, tmp_path)[0]
        truncate(first, first.stat().st_size // 2)
        expected = Engine(model, None).generate(ids[p_job], params).token_ids
        result = engine.generate(ids[p_job], params)  # raised KeyError before the fix
        assert result.token_ids == expected
        assert 0 < result.cached_tokens < 64 and result.hit_tiers == (
            "disk",
        )  # Q's entry, over the shared head
        # removed (or redone)
        assert store.stats()["store"]["unusable_entries"] == 1 and entry_ok(first) is not False
    finally:
        engine.close()
        without_history.close()
        store.close()


def _namespace():
    from kvfuse.kv.keys import Namespace

    return Namespace(
        tenant="", model_fingerprint="f" * 32, kv_dtype="float16", kv_layout="l", salt=""
    )


# ------------------------------------------------------------------------ damaged entries
DAMAGE = {
    "truncated to half": lambda p: truncate(p, p.stat().st_size // 2),
    "truncated to 7 bytes": lambda p: truncate(p, 7),
    "emptied": lambda p: truncate(p, 0),
    "bit flipped in the header": lambda p: flip_bit(p, 12, 3),
    "bit flipped in the last layer": lambda p: flip_bit(p, p.stat().st_size - 1, 5),
    "deleted": lambda p: p.unlink(),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_entries_damaged_under_a_running_server(model, shape, tmp_path):
    """Each document's first chunk (the entry its next request reads first) is damaged in another
    way while clients keep sending requests."""
    ref = Reference(lambda: model)
    job_list = shape.jobs(documents=max(shape.documents, len(DAMAGE)))
    disk = tmp_path / "kv"
    srv = serve(disk, shape)
    try:
        client = client_of(srv)
        warm_up(srv, client, ref, job_list, shape.threads, "disk", check_hits=False)
        firsts = [chain_paths(model, job, shape.chunk_size, disk)[0] for job in job_list]
        assert all(p.is_file() for p in firsts), (
            "the first chunks are not where the disk tier keeps them"
        )
        figures = {"damaged": 0, "deleted": 0, "requests": 0, "unusable": 0, "errors": 0}
        for cycle in range(shape.cycles):
            before = disk_counts(srv)
            damaged = {}
            with Load(client, job_list, shape.threads) as load:
                load.wait_done(1)
                for i, (kind, damage) in enumerate(DAMAGE.items()):
                    path = firsts[(i + cycle) % len(firsts)]
                    if path.exists():
                        damage(path)
                        damaged[path] = kind
                load.wait_new(len(job_list))  # every document asked for again: consecutive jobs
                outcomes = load.stop()
            check_outcomes(ref, outcomes)
            idle(srv)
            after = disk_counts(srv)
            corrupt = [p for p, kind in damaged.items() if kind != "deleted"]
            for p, kind in damaged.items():  # none is left damaged: removed, or stored again intact
                assert entry_ok(p) is not False, f"an entry {kind} is still on disk: {p}"
            d = delta(
                after, before, "unusable", "errors", "errors_in_metrics", "unusable_in_metrics"
            )
            assert d["unusable"] >= len(corrupt), (
                f"{len(corrupt)} damaged entries, {d['unusable']} counted unusable"
            )
            assert d["errors"] >= len(corrupt) and d["errors_in_metrics"] == d["errors"]
            assert d["unusable_in_metrics"] == d["unusable"]
            figures["damaged"] += len(corrupt)
            figures["deleted"] += len(damaged) - len(corrupt)
            figures["requests"] += len(outcomes)
            figures["unusable"] += d["unusable"]
            figures["errors"] += d["errors"]
        recovery = hits_again(srv, client, ref, job_list, "disk")
        record(
            label("disk_damaged_entries", shape),
            wrong=0,
            near_ties=ref.near_ties,
            identical=ref.identical,
            recovery_requests=recovery,
            **figures,
        )
    finally:
        srv.close()


# ------------------------------------------------------------------------------ full disk
@pytest.mark.slow  # both shapes: the default run keeps the damaged-entries test (CI time)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_full_disk(model, shape, tmp_path):
    """The disk tier's folder is a tmpfs with room for two or three entries while the tier's
    capacity says 1 GiB: writes fail with ENOSPC. Then the file system grows again."""
    ref = Reference(lambda: model)
    job_list = shape.jobs()
    with tmpfs(tmp_path / "kv", shape.full_disk) as disk:
        srv = serve(disk, shape, disk_bytes="1GiB")
        try:
            client = client_of(srv)
            ref.cache_free(client, job_list, shape.threads)
            before = disk_counts(srv)
            with Load(client, job_list, shape.threads) as load:
                load.wait_done(shape.per_phase * len(job_list) // 2)
                outcomes = load.stop()
            check_outcomes(ref, outcomes)
            idle(srv)
            after = disk_counts(srv)
            d = delta(after, before, "errors", "dropped_writes", "puts")
            assert d["errors"] > 0 and d["dropped_writes"] > 0, f"a full disk was not counted: {d}"
            assert after["errors_in_metrics"] == after["errors"]
            assert temp_files(disk) == [], "failed writes left temp files on the full disk"
            on_disk = sum(p.stat().st_size for p in entry_files(disk))
            assert after["used_bytes"] == on_disk, "the tier's size is not what its files hold"
            # the file system grows: writes succeed again and are read back
            remount(disk, "256m")
            again = run_all(client, job_list, shape.threads)
            check_outcomes(ref, again)
            idle(srv)
            grown = disk_counts(srv)
            assert grown["puts"] > after["puts"] and grown["errors"] == after["errors"], (
                f"writes still fail on a disk with room: {delta(grown, after, 'puts', 'errors')}"
            )
            hits = run_all(client, job_list, shape.threads)
            check_outcomes(ref, hits)
            assert all(o.by_tier.get("disk") for o in hits), [o.by_tier for o in hits]
            record(
                label("disk_full", shape),
                wrong=0,
                near_ties=ref.near_ties,
                identical=ref.identical,
                requests=len(outcomes) + len(again) + len(hits),
                errors=d["errors"],
                dropped_writes=d["dropped_writes"],
                puts_while_full=d["puts"],
                puts_after_growing=grown["puts"] - after["puts"],
            )
        finally:
            srv.close()


# ----------------------------------------------------------------------- permission denied
@pytest.mark.slow  # the tier-level test above runs by default
def test_folders_and_files_the_server_may_not_read(model, tmp_path):
    """chmod 000 on one entry file and on one fan-out folder, the server running as root without
    CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (root otherwise ignores permissions): a real EACCES,
    at run time and at start-up. No mock."""
    why = can_drop_dac()
    if why:
        pytest.skip(why)
    shape = FAST
    ref = Reference(lambda: model)
    job_list = shape.jobs()
    disk = tmp_path / "kv"
    locked: list[tuple[Path, int]] = []

    def lock(path: Path) -> None:
        locked.append((path, stat.S_IMODE(path.stat().st_mode)))
        path.chmod(0)

    def unlock() -> None:
        while locked:
            path, mode = locked.pop()
            if path.exists():  # a locked file may have been replaced or cleared since
                path.chmod(mode)

    srv = serve(
        disk, shape, cls=lambda *a, **kw: PrefixedServer(*a, prefix=["setpriv", *NO_DAC], **kw)
    )
    try:
        client = client_of(srv)
        warm_up(srv, client, ref, job_list, shape.threads, "disk", check_hits=False)
        firsts = [chain_paths(model, job, shape.chunk_size, disk)[0] for job in job_list]
        locked_file = firsts[0]
        locked_dir = next(p.parent for p in firsts[1:] if p.parent != locked_file.parent)
        in_locked_dir = [p for p in firsts if p.parent == locked_dir]
        lock(locked_file)
        lock(locked_dir)
        before = disk_counts(srv)
        with Load(client, job_list, shape.threads) as load:
            load.wait_new(len(job_list))
            outcomes = load.stop()
        check_outcomes(ref, outcomes)
        idle(srv)
        after = disk_counts(srv)
        d = delta(after, before, "errors", "errors_in_metrics")
        assert d["errors"] > 0 and d["errors_in_metrics"] == d["errors"], f"EACCES not counted: {d}"
        # still locked: the server could not have worked around it
        assert locked_dir.stat().st_mode & 0o777 == 0

        # a restart with the folder still locked: the start-up scan must not stop the server
        srv.close()
        srv = serve(
            disk, shape, cls=lambda *a, **kw: PrefixedServer(*a, prefix=["setpriv", *NO_DAC], **kw)
        )
        client = client_of(srv)
        out = run_all(client, job_list, shape.threads)
        check_outcomes(ref, out)
        idle(srv)
        assert tier(srv, "disk")["errors"] > 0
        # clearing the cache skips what it cannot read and removes the rest
        r = httpx.delete(srv.base_url + "/kv", timeout=60)
        assert r.status_code == 200, r.text
        unlock()
        left = entry_files(disk)
        assert left and all(p.parent == locked_dir for p in left), (
            f"DELETE /v1/kv left entries outside the locked folder: {[p for p in left if p.parent != locked_dir]}"
        )
        # permissions back: the locked entries are served again
        more = run_all(
            client,
            [
                job_list[job_list.index(j)]
                for j in job_list
                if any(
                    p.parent == locked_dir
                    for p in chain_paths(model, j, shape.chunk_size, disk)[:1]
                )
            ],
            shape.threads,
        )
        check_outcomes(ref, more)
        assert all(o.by_tier.get("disk") for o in more), [o.by_tier for o in more]
        record(
            "disk_permission_denied[fast]",
            wrong=0,
            near_ties=ref.near_ties,
            identical=ref.identical,
            requests=len(outcomes) + len(out) + len(more),
            errors=d["errors"],
            locked_entries=1 + len(in_locked_dir),
            restarts=1,
        )
    finally:
        unlock()
        srv.close()


# ------------------------------------------------------------------------- killed mid-write
@pytest.mark.slow  # both shapes (CI time); torn writes are also tests/unit/test_disk_tier.py's
@pytest.mark.parametrize("shape", SHAPES)
def test_a_server_killed_in_the_middle_of_writes_restarts_clean(model, shape, tmp_path):
    """Many concurrent long prompts (every chunk new), SIGKILL while the saver and the writer are
    busy, then a restart on the same folder: what a torn write or a crash can leave behind is
    planted too (a dead process's temp files, a torn entry, a torn expiry-journal line, a history
    record's temp file)."""
    ref = Reference(lambda: model)
    job_list = shape.jobs()  # their chunks together: more than the capacity holds
    disk = tmp_path / "kv"
    capacity = shape.capacity
    cap_bytes = int(capacity[:-3]) * 1024**2
    srv = serve(disk, shape, disk_bytes=capacity, retention="1h")
    figures = {
        "kills": 0,
        "requests": 0,
        "temp_files_left": 0,
        "unusable": 0,
        "reused_after_restart": 0,
    }
    try:
        client = client_of(srv)
        ref.cache_free(client, job_list, shape.threads)
        for cycle in range(shape.cycles):
            # every chunk new: the server has writes to do when it is killed
            salt = f"cycle-{cycle}"
            puts0 = tier(srv, "disk")["puts"]

            def writing():  # entries written, and more coming: saves queued, or requests running
                s = kv_stats(srv)
                busy = (
                    s["tiers"]["store"]["queue_depth"]
                    or s["engine"]["saver"]["pending"]
                    or s["queue"]["running"]
                )
                return busy and s["tiers"]["disk"]["puts"] >= puts0 + 3

            with Load(client, job_list, shape.threads, cache_salt=salt) as load:
                wait_until(writing, 300, "the server to be writing entries")
                pid = srv.pid
                os.kill(pid, signal.SIGKILL)
                srv.proc.wait()
                killed = time.monotonic()
                outcomes = load.stop()
            finished = [o for o in outcomes if o.started + o.latency_s < killed and o.error is None]
            # those answered before the kill; the others lost their server
            check_outcomes(ref, finished)
            figures["kills"] += 1
            figures["requests"] += len(finished)
            figures["temp_files_left"] += len(temp_files(disk))

            # what a crash can also leave: a dead writer's temp files, a torn entry, a torn journal line
            sub = next(p for p in sorted(disk.iterdir()) if p.is_dir() and len(p.name) == 2)
            (sub / f".{pid}.{os.urandom(8).hex()}.tmp").write_bytes(os.urandom(100_000))
            (disk / "histories").mkdir(exist_ok=True)
            # a record's
            (disk / "histories" / f".{pid}.{os.urandom(12).hex()}.tmp").write_bytes(b"partial")
            with open(disk / "expiry.log", "ab") as f:
                f.write(b"torn line without its newl")
            present = [
                (job, p)
                for job in job_list
                for p in chain_paths(model, job, shape.chunk_size, disk, salt)[:1]
                if p.exists()
            ]
            assert present, "the killed server had written no first chunk"
            torn = present[0][1]
            # as if the rename had reached the disk, not the data
            truncate(torn, torn.stat().st_size // 2)
            srv.close()

            srv = serve(disk, shape, disk_bytes=capacity, retention="1h")
            client = client_of(srv)
            assert temp_files(disk) == [], f"temp files left after the restart: {temp_files(disk)}"
            start = kv_stats(srv)["tiers"]["disk"]
            on_disk = sum(p.stat().st_size for p in entry_files(disk))
            assert start["used_bytes"] == on_disk <= cap_bytes, (
                start["used_bytes"],
                on_disk,
                cap_bytes,
            )
            assert b"torn line" not in (disk / "expiry.log").read_bytes(), (
                "the journal was not compacted"
            )
            before = disk_counts(srv)
            # Asked first, one by one: every request writes new chunks, which evict the oldest ones.
            intact = [job for job, p in present[1:] if p.exists()][:1]  # (not evicted at start-up)
            first = intact + [job for job, p in present if p == torn]
            again = [o for job in first for o in run_all(client, [job], 1, cache_salt=salt)]
            again += run_all(
                client, [j for j in job_list if j not in first], shape.threads, cache_salt=salt
            )
            check_outcomes(ref, again)
            idle(srv)
            after = disk_counts(srv)
            assert after["unusable"] - before["unusable"] >= 1, "the torn entry was not counted"
            assert entry_ok(torn) is not False, "the torn entry is still on disk"
            reused = [o for o in again if o.by_tier.get("disk")]
            assert not intact or intact[0] in [o.job for o in reused], (
                "entries written before the kill not reused"
            )
            figures["unusable"] += after["unusable"] - before["unusable"]
            figures["requests"] += len(again)
            figures["reused_after_restart"] += len(reused)
            end = tier(srv, "disk")
            # + journal, records
            assert end["used_bytes"] <= cap_bytes and used_bytes(disk) <= cap_bytes + 1024**2
        record(
            label("disk_killed_mid_write", shape),
            wrong=0,
            near_ties=ref.near_ties,
            identical=ref.identical,
            **figures,
        )
    finally:
        srv.close()
