"""What a real ``kvfuse serve`` leaves at rest (issue 39, items 9 and 12): its files are its
owner's only, and a history record tampered with in its shared folder is never used.

One server with a signing key, a disk tier and a Responses store in a temp folder: a stored
response and its follow-up write entries, history records and SQLite rows, all 0600 in folders
0700. Before it starts, the histories folder gets an unsigned record and one signed with an
attacker's key, naming another tenant's entries: the server refuses both (counted) and removes
them. The record blob of the stored response is then replaced by the same record unsigned (what
a writer without the key can make): the follow-up is still answered, the record refused, counted.
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
from kvfuse.private import make_dirs, write_new
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
    """Plant an unsigned record and one signed with another key, both naming other entries
    (files 0600 in folders 0700, like the server's own)."""
    ns = Namespace("model", "float16", "L2xH1xD4", tenant="mallory")
    ids = list(range(1000, 1064))
    entries = tuple(StoredEntry(k, i * 32, 32) for i, k in enumerate(prefix_keys(ids, 32, ns)))
    rec = Record(ns.key_prefix(), np.asarray(ids, np.uint32), ns, entries)
    make_dirs(histories)
    write_new(histories / "unsigned.rec", encode_record(rec))
    stranger = EntrySigner([b"a key an attacker made up, 32 bytes long"])
    write_new(histories / "stranger.rec", encode_record(rec, stranger))


def test_files_at_rest_are_private_and_tampered_records_are_not_used(kvfuse_home, tmp_path):
    ensure_model(kvfuse_home, MODEL)
    state = tmp_path / "state"
    db = state / "responses.sqlite3"
    histories = state / "kv" / "histories"
    forged_records(histories)  # found in the shared folder when the server starts
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(state / "kv"), "signing_key": KEY},
        "responses": {"path": str(db)},
    }
    srv = ServerProcess(kvfuse_home, config=config).start(timeout=300)
    try:
        assert metric(srv, "kvfuse_history_records_refused") == 2
        assert not list(histories.glob("*.rec"))  # refused: removed
        c = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        question = "Tell me about lighthouses. " * 12
        first = c.responses.create(model=MODEL, input=question, max_output_tokens=4)
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
        assert again.status in ("completed", "incomplete")  # answered (max_output_tokens)
        assert metric(srv, "kvfuse_responses", '{event="record_refused"}') == 1
    finally:
        srv.close()  # a clean stop: the saves and records are written
    assert list(histories.glob("*.rec"))  # the turns' own records, signed
    found = modes(state)
    print(f"  modes at rest: { ({k: sorted(map(oct, v)) for k, v in found.items()}) }")
    assert found == {"files": {0o600}, "folders": {0o700}}
