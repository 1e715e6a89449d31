"""The ``kvfuse`` command line, run as a real process: models, generate, cache, and its user errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvfuse_helpers import builtin_folder, long_text, model_home

pytestmark = pytest.mark.integration

VERBOSE = re.compile(r"prompt (\d+) tokens \((\d+) cached(?: from ([a-z,]+))?\)")


def kvfuse(
    args: list[str],
    disk: Path | None = None,
    stdin: str | None = None,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m kvfuse.cli ARGS`` with the test model home and (optionally) its own disk cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFUSE_")}
    env["KVFUSE_HOME"] = str(model_home())
    env.update(env_extra or {})
    if disk is not None:
        env["KVFUSE_CACHE_DISK_PATH"] = str(disk)
    return subprocess.run(
        [sys.executable, "-m", "kvfuse.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("kvfuse: error:"), proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def smollm2_ready() -> Path:
    return builtin_folder("smollm2")


def test_models_list_shows_both_builtins(smollm2_ready):
    proc = kvfuse(["models", "list"])
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert {"smollm2", "gemma3-270m"} <= set(rows)
    assert rows["smollm2"].split()[1] == "ready"


def test_models_list_names_the_cpu_backend():
    """The CPU path a model would load with: a line after the models, from ``kernels``."""
    proc = kvfuse(["models", "list"], env_extra={"KVFUSE_KERNELS": "off", "KVFUSE_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr
    *_, line, cpu = proc.stdout.splitlines()
    assert line == "CPU backend: kernels off (kernels: off), weights plain (device cpu, float32)"
    assert cpu.startswith("CPU: ") and "GGUF kernels: " in cpu  # the CPU's instruction sets
    proc = kvfuse(["models", "list"], env_extra={"KVFUSE_DEVICE": "cpu"})
    assert proc.returncode == 0 and "CPU backend: " in proc.stdout, proc.stderr
    assert_user_error(
        kvfuse(["models", "list"], env_extra={"KVFUSE_KERNELS": "fast"}),
        "kernels:",
        "KVFUSE_KERNELS",
    )


def test_pulling_an_unknown_model_lists_the_known_names():
    assert_user_error(kvfuse(["models", "pull", "bogus"]), "'bogus'", "smollm2", "gemma3-270m")


def test_generate_answers_in_chat_mode_with_timings_on_stderr(smollm2_ready, tmp_path):
    proc = kvfuse(
        [
            "generate",
            "--model",
            "smollm2",
            "--chat",
            "--max-tokens",
            "8",
            "--verbose",
            "What is the capital of France?",
        ],
        disk=tmp_path / "kv",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout and "[kvfuse]" not in proc.stdout
    assert "time to first token" in proc.stderr and VERBOSE.search(proc.stderr)


def test_chat_reuses_the_whole_history_turn_after_turn_and_truncates_when_asked(
    smollm2_ready, tmp_path
):
    turns = "What is the capital of France?\nAnd of Italy?\n\nWhich of the two is larger?\n"
    proc = kvfuse(
        ["chat", "--model", "smollm2", "--max-tokens", "12", "-v", "--system", "Be brief."],
        disk=tmp_path / "kv",
        stdin=turns,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [tuple(map(int, m.groups()[:2])) for m in VERBOSE.finditer(proc.stderr)]
    # blank lines skipped
    assert len(rows) == 3 and rows[0][1] == 0 and len(proc.stdout.strip().splitlines()) == 3
    for (prompt, _), (next_prompt, cached) in zip(rows, rows[1:]):
        assert cached >= prompt  # the previous prompt and (all but the last token of) its answer
    small = kvfuse(
        [
            "chat",
            "--model",
            "smollm2",
            "--max-tokens",
            "12",
            "-v",
            "--context-tokens",
            "80",
            "--truncation",
            "recompute",
            "--no-disk",
        ],
        stdin=turns,
    )
    assert small.returncode == 0, small.stderr[-2000:]
    assert "oldest messages dropped" in small.stderr
    bad = kvfuse(["chat", "--truncation", "sometimes"], stdin="")
    assert bad.returncode == 2 and "--truncation" in bad.stderr and "reuse" in bad.stderr


@pytest.mark.parametrize(
    "flag,value,field",
    [
        ("--temperature", "-1", "temperature"),
        ("--max-tokens", "0", "max_tokens"),
        ("--top-p", "0", "top_p"),
    ],
)
def test_bad_sampling_flags_exit_2_naming_the_field(flag, value, field):
    assert_user_error(kvfuse(["generate", "--model", "smollm2", flag, value, "hi"]), field)


def test_a_bad_config_file_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  chunksize: 128\n")
    assert_user_error(kvfuse(["cache", "stats", "--config", str(bad)]), "cache.chunksize", str(bad))
    assert_user_error(kvfuse(["generate", "--config", str(bad), "hi"]), "cache.chunksize")


@pytest.fixture(scope="module")
def long_runs(smollm2_ready, tmp_path_factory):
    """The same ~600-token prompt (from stdin) generated by two fresh processes sharing a disk cache."""
    disk = tmp_path_factory.mktemp("cli") / "kv"
    prompt = long_text() + "\n\nQuestion: Who built the lighthouse of Velmora?\nAnswer:"
    runs = [
        kvfuse(
            ["generate", "--model", "smollm2", "--max-tokens", "4", "--verbose", "-"],
            disk=disk,
            stdin=prompt,
        )
        for _ in range(2)
    ]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return disk, runs


def test_a_second_process_reuses_the_prompt_from_disk(long_runs):
    _, (first, second) = long_runs
    prompt_tokens, cached, tiers = VERBOSE.search(first.stderr).groups()
    assert 512 < int(prompt_tokens) < 768 and cached == "0" and tiers is None
    prompt_tokens2, cached, tiers = VERBOSE.search(second.stderr).groups()
    # the first process's history (its record and entries, on disk) covers all but the last token;
    # read from disk by the request or, a moment before it, by the prefetcher
    assert (
        prompt_tokens2 == prompt_tokens
        and int(cached) == int(prompt_tokens) - 1
        and tiers in ("disk", "memory", "disk,memory")
    )
    assert second.stdout == first.stdout


def test_cache_stats_inspect_and_clear(long_runs, tmp_path):
    disk, _ = long_runs
    stats = kvfuse(["cache", "stats"], disk=disk)
    # two whole chunks of the prompt, and the history's tail (the prompt's rest and the answer)
    assert stats.returncode == 0 and re.search(r"disk\s+3 entries", stats.stdout), (
        stats.stdout + stats.stderr
    )
    stats = kvfuse(["cache", "stats", "--json"], disk=disk)
    assert json.loads(stats.stdout)["disk"]["entries"] == 3

    entry = max(disk.glob("*/*.kvf"), key=lambda p: p.stat().st_size)  # a whole chunk, not the tail
    proc = kvfuse(["cache", "inspect", str(entry)], disk=disk)
    assert proc.returncode == 0, proc.stderr
    header = json.loads(proc.stdout)
    assert (
        header["source"] == str(entry) and header["codec"] == "raw" and header["payload_ok"] is True
    )
    assert header["num_positions"] == 256 and header["dtype"] == "float16"
    by_key = kvfuse(["cache", "inspect", header["key"]], disk=disk)
    assert by_key.returncode == 0 and json.loads(by_key.stdout)["source"] == "disk"

    garbage = tmp_path / "garbage.kvf"
    garbage.write_bytes(b"this is not a cache entry at all" * 10)
    assert_user_error(
        kvfuse(["cache", "inspect", str(garbage)], disk=disk),
        "not a valid kvfuse entry",
        str(garbage),
    )
    assert_user_error(kvfuse(["cache", "inspect", "no-such-key"], disk=disk), "no-such-key")

    cleared = kvfuse(["cache", "clear"], disk=disk)
    assert cleared.returncode == 0 and "removed 3 entries" in cleared.stdout
    assert (
        json.loads(kvfuse(["cache", "stats", "--json"], disk=disk).stdout)["disk"]["entries"] == 0
    )


def test_a_missing_signing_key_file_is_a_user_error(tmp_path):
    """The default run's check of signing through the CLI (the whole path is the slow test below;
    signed entries themselves are tested in tests/reliability/test_signed_entries.py)."""
    missing = kvfuse(
        ["cache", "stats"],
        disk=tmp_path / "kv",
        env_extra={"KVFUSE_CACHE_SIGNING_KEY_FILE": str(tmp_path / "absent.keys")},
    )
    assert_user_error(missing, "cache.signing_key_file", "absent.keys", "openssl rand -hex 32")


@pytest.mark.slow  # six model-loading processes (~40 s); the pieces are covered by faster tests
def test_signed_entries_through_the_cli(smollm2_ready, tmp_path):
    """A key file in the environment: a second process reuses the first one's signed entries,
    ``cache inspect`` reports their signature, a process with another key refuses them, and a
    missing key file is a user error naming the fix. No command prints a key."""
    disk, key, other = tmp_path / "kv", "ab" * 32, "cd" * 32
    for name, k in (("signing.keys", key), ("other.keys", other)):
        (tmp_path / name).write_text(f"{k}\n")
        (tmp_path / name).chmod(0o600)
    env = {
        "KVFUSE_CACHE_SIGNING_KEY_FILE": str(tmp_path / "signing.keys"),
        "KVFUSE_CACHE_CHUNK_SIZE": "32",
    }
    intruder = {**env, "KVFUSE_CACHE_SIGNING_KEY_FILE": str(tmp_path / "other.keys")}
    generate = ["generate", "--model", "smollm2", "--max-tokens", "2", "--verbose", "-"]
    prompt = long_text(1) + "\n\nSummary:"
    runs = [kvfuse(generate, disk=disk, stdin=prompt, env_extra=env) for _ in range(2)]
    assert [int(VERBOSE.search(r.stderr).group(2)) > 0 for r in runs] == [False, True], runs[
        1
    ].stderr[-2000:]
    listing = json.loads(kvfuse(["cache", "inspect", "--json"], disk=disk, env_extra=env).stdout)
    assert listing["entries"] and {r["signature"] for r in listing["entries"]} == {"valid"}
    seen = kvfuse(["cache", "inspect"], disk=disk, env_extra=intruder)
    assert "signed by no accepted key: refused" in seen.stdout
    refused = kvfuse(generate, disk=disk, stdin=prompt, env_extra=intruder)
    assert VERBOSE.search(refused.stderr).group(2) == "0" and refused.stdout == runs[0].stdout
    missing = kvfuse(
        ["cache", "stats"],
        disk=disk,
        env_extra={"KVFUSE_CACHE_SIGNING_KEY_FILE": str(tmp_path / "absent.keys")},
    )
    assert_user_error(missing, "cache.signing_key_file", "absent.keys", "openssl rand -hex 32")
    for proc in (*runs, seen, refused, missing):
        assert key not in proc.stdout + proc.stderr and other not in proc.stdout + proc.stderr


def test_cachegen_on_disk_listed_by_inspect_and_streamed_back(smollm2_ready, tmp_path):
    """Raw in memory, CacheGen level 2 on disk (set explicitly: level 0 would be the model's
    calibrated level) plus levels 1 and 3 for streaming; a second process streams the prompt back
    from disk within a budget."""
    disk = tmp_path / "kv"
    env = {
        "KVFUSE_CACHE_DISK_CODEC": "cachegen",
        "KVFUSE_CACHE_DISK_CODEC_LEVEL": "2",
        "KVFUSE_CACHE_STREAM_LEVELS": "1,3",
        "KVFUSE_CACHE_HISTORY": "false",
    }
    prompt = long_text() + "\n\nQuestion: Who built the lighthouse of Velmora?\nAnswer:"
    args = ["generate", "--model", "smollm2", "--max-tokens", "4", "--verbose", "-"]
    first = kvfuse(args, disk=disk, stdin=prompt, env_extra=env)
    assert first.returncode == 0, first.stderr[-2000:]

    listing = kvfuse(["cache", "inspect"], disk=disk)
    assert listing.returncode == 0, listing.stderr
    lines = [ln for ln in listing.stdout.splitlines() if ln.startswith("disk ")]
    # two chunks x (primary + 2 levels); a summary line per level
    assert len(lines) == 6 + 3, listing.stdout
    data = json.loads(kvfuse(["cache", "inspect", "--json"], disk=disk).stdout)
    by_level = {(e["codec"], e["level"]): e for e in data["entries"]}
    assert set(by_level) == {("cachegen", 1), ("cachegen", 2), ("cachegen", 3)}
    assert (
        by_level[("cachegen", 2)]["ratio"] > 5
        and by_level[("cachegen", 1)]["ratio"] > by_level[("cachegen", 3)]["ratio"]
    )
    assert all(e["intact"] and e["tokens"] == 256 for e in data["entries"])
    assert {s["encoding"] for s in data["summary"]} == {"cachegen.1", "cachegen.2", "cachegen.3"}
    one = json.loads(
        kvfuse(["cache", "inspect", by_level[("cachegen", 1)]["key"]], disk=disk).stdout
    )
    assert one["level"] == 1 and one["compression_ratio"] > 5 and one["key"].endswith("@cachegen.1")

    second = kvfuse(
        [*args[:-1], "--kv-slo-ms", "60000", "-"], disk=disk, stdin=prompt, env_extra=env
    )
    assert second.returncode == 0, second.stderr[-2000:]
    _, cached, tiers = VERBOSE.search(second.stderr).groups()
    assert cached == "512" and tiers == "disk"
    assert re.search(
        r"streamed from slow tiers: 2 raw|streamed from slow tiers: .*cachegen", second.stderr
    ), second.stderr
    assert_user_error(kvfuse(["cache", "inspect", "--limit", "0"], disk=disk), "--limit")


def test_calibrate_writes_a_profile_and_generate_reports_the_blend(smollm2_ready, tmp_path):
    """``kvfuse calibrate`` measures the given grid and the CacheGen levels and writes a profile
    tied to the model; a generate with documents says which blend it used and where its budget
    came from."""
    out = tmp_path / "profile.json"
    proc = kvfuse(
        [
            "calibrate",
            "smollm2",
            "--items",
            "2",
            "--methods",
            "hkvd",
            "--ratios",
            "1",
            "--contexts",
            "bos",
            "--sources",
            "fictional",
            "--codec-items",
            "1",
            "--output",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "full prefill" in proc.stdout and "hkvd 1" in proc.stdout and str(out) in proc.stdout
    # stderr is a pipe, not a terminal: progress lines instead of the bar
    assert "kvfuse calibrate: choice part 1/1 items (100%)" in proc.stderr, proc.stderr[-2000:]
    assert "early elimination: 2 of 2 setting runs" in proc.stdout
    assert "cachegen level" in proc.stdout and "smollm2: CacheGen level" in proc.stdout
    prof = json.loads(out.read_text())
    assert prof["model"] == "smollm2" and len(prof["fingerprint"]) == 32
    assert prof["command"].startswith(
        "kvfuse calibrate smollm2 --items 2 --methods hkvd --ratios 1"
    )
    assert prof["command"].endswith("--codec-items 1")
    assert prof["blend"]["method"] in ("hkvd", "prefix") and prof["reason"]
    assert [r["config"] for r in prof["measured"]] == ["full prefill", "full reuse", "hkvd 1"]
    codec = prof["codec"]
    assert (
        codec["cachegen_level"] in (1, 2, 3, 4) and codec["reason"] and codec["meta"]["items"] == 1
    )
    # every level without and with K's outlier-channel cap; the profile names the chosen cap
    assert [(r["level"], r["k_cap"]) for r in codec["measured"]] == [
        (lv, cap) for lv in (1, 2, 3, 4) for cap in (None, 4.0)
    ]
    assert all(r["ratio_vs_int8"] > 1 for r in codec["measured"]) and "k_cap" in codec
    doc = tmp_path / "doc.txt"
    doc.write_text("Velmora's lighthouse was built in 1847 by the stonemason Ilse Garrow.")
    proc = kvfuse(
        [
            "generate",
            "--model",
            "smollm2",
            "--document",
            str(doc),
            "--recompute-ratio",
            "0.5",
            "--max-tokens",
            "4",
            "--verbose",
            "Who built the lighthouse?",
        ],
        disk=tmp_path / "kv",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "blend hkvd at 0.5 (from the request)" in proc.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["calibrate", "smollm2", "--methods", "magic"], ["--methods", "magic", "hkvd"]),
        (["calibrate", "smollm2", "--ratios", "2"], ["recompute budget", "[0, 1]"]),
        (["calibrate", "smollm2", "--contexts", "elsewhere"], ["--contexts", "prefix"]),
    ],
)
def test_calibrate_rejects_bad_flags_naming_the_fix(args, words):
    assert_user_error(kvfuse(args), *words)


def test_calibrate_codec_part_keeps_a_profile_of_the_model_only(smollm2_ready, tmp_path):
    """``--part codec`` adds the level to the model's profile: a file at --output that is another
    model's is an error naming the fix, not a profile to change."""
    out = tmp_path / "other.json"
    out.write_text(
        json.dumps(
            {
                "format": 1,
                "model": "other",
                "fingerprint": "0" * 32,
                "reason": "test",
                "command": "test",
                "blend": {"method": "hkvd", "recompute_ratio": 0.3},
            }
        )
    )
    assert_user_error(
        kvfuse(["calibrate", "smollm2", "--part", "codec", "--output", str(out)]),
        "another model",
        "--part all",
    )
    proc = kvfuse(["calibrate", "smollm2", "--part", "everything"])
    assert proc.returncode == 2 and "codec" in proc.stderr and "blend" in proc.stderr


def test_a_bad_recompute_ratio_flag_is_a_usage_error():
    proc = kvfuse(["generate", "--recompute-ratio", "most", "hi"])
    assert proc.returncode == 2 and "or auto" in proc.stderr
