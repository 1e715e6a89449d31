"""``kvfuse responses list|show|delete|purge`` on a real SQLite file and a real disk tier."""

from __future__ import annotations

import json
import time

import pytest

from kvfuse.cli import main
from kvfuse.history.response_store import ResponseStore, StoredResponse
from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.tiers import DiskTier


@pytest.fixture
def home(tmp_path):
    ns = Namespace("model", "float16", "L2")
    keys = prefix_keys(list(range(64)), 16, ns)  # 4 chunk keys
    disk = DiskTier(tmp_path / "kv", 1 << 30)
    for k in keys:
        disk.put(k, b"x" * 100)
    store = ResponseStore(tmp_path / "responses.sqlite3", ttl_s=3600)
    now = time.time()
    store.put(
        StoredResponse(
            "resp_a",
            "",
            now,
            {"id": "resp_a", "output": []},
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first answer"}],
            keys=[str(k) for k in keys[:3]],
        )
    )
    store.put(
        StoredResponse(
            "resp_b",
            "",
            now,
            {"id": "resp_b"},
            [{"role": "user", "content": "q"}],
            keys=[str(k) for k in keys[:2]],
            previous_id="resp_a",
        )
    )
    store.put(
        StoredResponse("resp_old", "t2", now - 7200, {"id": "resp_old"}, [], keys=[str(keys[3])])
    )
    store.close()
    return tmp_path, keys, disk


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_show(home, capsys):
    path, _, _ = home
    code, out, _ = run(capsys, "responses", "list", "--home", str(path), "--json")
    assert code == 0 and {r["id"] for r in json.loads(out)} == {"resp_a", "resp_b", "resp_old"}
    code, out, _ = run(capsys, "responses", "list", "--home", str(path), "--tenant", "")
    assert code == 0 and "resp_a" in out and "first answer" in out and "resp_old" not in out
    code, out, _ = run(capsys, "responses", "show", "resp_a", "--home", str(path))
    assert code == 0 and json.loads(out)["id"] == "resp_a"
    # another tenant's
    code, _, err = run(capsys, "responses", "show", "resp_old", "--home", str(path))
    assert code == 2 and "kvfuse responses list" in err


def test_delete_frees_only_unshared_entries_and_purge_expired(home, capsys):
    path, keys, disk = home
    code, out, _ = run(capsys, "responses", "delete", "resp_a", "--home", str(path))
    assert code == 0 and "freed 1 entries" in out
    assert [disk.contains(k) for k in keys] == [
        True,
        True,
        False,
        True,
    ]  # resp_b still refers to the first two
    code, out, _ = run(capsys, "responses", "purge", "--home", str(path))
    assert code == 0 and "removed 1 expired" in out and "freed 1 entries" in out
    assert not disk.contains(keys[3])
    code, _, err = run(capsys, "responses", "delete", "resp_a", "--home", str(path))
    assert code == 2 and "no response" in err


def test_no_database_is_a_clear_error(tmp_path, capsys):
    code, _, err = run(capsys, "responses", "list", "--home", str(tmp_path))
    assert code == 2 and "responses.path" in err
