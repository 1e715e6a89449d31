"""What a real ``kvfuse serve`` leaves at rest (issue 39, items 9 and 12): its files are its
owner's only, and a history record tampered with in its shared folder is never used.

One server with a signing key, a disk tier and a Responses store in a temp folder: a stored
response and a follow-up write entries, history records and SQLite rows. Then the record blob of
the stored response is replaced by the same record unsigned (what a writer without the key can
make): the next follow-up is still answered, the record is refused and counted. Then, server
stopped, the histories folder gets an unsigned record and one signed with an attacker's key,
naming another tenant's entries: the restarted server refuses both (counted) and removes them.
"""

from __future__ import annotations

import os
import re
import sqlite3
import stat
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

from kvfuse.history.records import Record, StoredEntry, decode_record, encode_record
from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.kv.signing import EntrySigner
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
KEY = "the service's own signing key, 256 bits, at least 32 bytes"


def metric(srv: ServerProcess, name: str, labels: str = "") -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    m = re.search(rf"^{name}(?:_total)?{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def modes(root: Path) -> dict[str, set[int]]:
    """The permission bits of every file and folder under ``root`` (``root`` itself excluded)."""
    out: dict[str, set[int]] = {"files": set(), "folders": set()}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out["folders"].add(stat.S_IMODE(os.stat(os.path.join(folder, d)).st_mode))
        for f in files:
            out["files"].add(stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode))
    return out


def forged_records(histories: Path) -> None:
    """Plant an unsigned record and one signed with another key, both naming other entries."""
    ns = Namespace("model", "float16", "L2xH1xD4", tenant="mallory")
    ids = list(range(1000, 1064))
    entries = tuple(StoredEntry(k, i * 32, 32) for i, k in enumerate(prefix_keys(ids, 32, ns)))
    rec = Record(ns.key_prefix(), np.asarray(ids, np.uint32), ns, entries)
    (histories / "unsigned.rec").write_bytes(encode_record(rec))
    stranger = EntrySigner([b"a key an attacker made up, 32 bytes long"])
    (histories / "stranger.rec").write_bytes(encode_record(rec, stranger))


def test_files_at_rest_are_private_and_tampered_records_are_not_used(kvfuse_home, tmp_path):
    ensure_model(kvfuse_home, MODEL)
    state = tmp_path / "state"  # made by the server
    db = state / "responses.sqlite3"
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(state / "kv"), "signing_key": KEY},
        "responses": {"path": str(db)},
    }
    srv = ServerProcess(kvfuse_home, config=config).start(timeout=300)
    try:
        c = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        question = "Tell me about lighthouses. " * 12
        first = c.responses.create(model=MODEL, input=question, max_output_tokens=4)
        c.responses.create(
            model=MODEL, input="And ships?", previous_response_id=first.id, max_output_tokens=4
        )
        with sqlite3.connect(db) as conn:
            (blob,) = conn.execute(
                "SELECT record FROM responses WHERE id = ?", (first.id,)
            ).fetchone()
            rec = decode_record(blob, EntrySigner([KEY.encode()]))  # stored signed
            conn.execute(
                "UPDATE responses SET record = ? WHERE id = ?", (encode_record(rec), first.id)
            )
        again = c.responses.create(
            model=MODEL, input="And trains?", previous_response_id=first.id, max_output_tokens=4
        )
        assert again.status == "completed"
        assert metric(srv, "kvfuse_responses", '{event="record_refused"}') == 1
        httpx.get(srv.url + "/health", timeout=10)  # the saves land before the stop
    finally:
        srv.stop()
    found = modes(state)
    print(f"  modes at rest: { ({k: sorted(map(oct, v)) for k, v in found.items()}) }")
    assert found == {"files": {0o600}, "folders": {0o700}}
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    histories = state / "kv" / "histories"
    assert list(histories.glob("*.rec"))  # the turns' records, signed
    forged_records(histories)
    srv = ServerProcess(kvfuse_home, config=config).start(timeout=300)
    try:
        assert metric(srv, "kvfuse_history_records_refused") == 2
        assert not (histories / "unsigned.rec").exists()
        assert not (histories / "stranger.rec").exists()
    finally:
        srv.close()
