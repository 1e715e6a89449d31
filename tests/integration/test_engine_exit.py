"""A program that uses the engine API and returns without ``Engine.close()``: it exits cleanly and
its queued saves reach the disk tier (``kvfuse.engine.at_exit``). It used to abort ("terminate
called without an active exception") when a saver thread was inside a copy at finalization, and
the write-behind disk writes still queued were lost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvfuse_helpers import load_builtin, long_text

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)

# The whole program: one generation whose chunks are saved behind it, then the end of the script.
PROGRAM = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from kvfuse_helpers import load_builtin, long_text
    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.store import TieredStore
    from kvfuse.tiers import DiskTier, MemoryTier

    model = load_builtin("smollm2")
    store = TieredStore(MemoryTier(1 << 30), [DiskTier({disk!r}, 1 << 30)])
    engine = Engine(model, store, EngineSettings.of(history=False))
    ids = model.tokenizer.encode(long_text() * 2)
    result = engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    print("stored", result.stored_chunks, flush=True)
    """
)


def test_exit_without_close_is_clean_and_keeps_the_saves(tmp_path):
    disk = tmp_path / "kv"
    program = PROGRAM.format(tests=str(TESTS), disk=str(disk))
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    assert "cannot schedule new futures" not in done.stderr, done.stderr[-3000:]
    stored = int(done.stdout.split()[-1])
    assert stored >= 4

    model = load_builtin("smollm2")
    ids = model.tokenizer.encode(long_text() * 2)
    with TieredStore(MemoryTier(1 << 30), [DiskTier(disk, 1 << 30)]) as store:
        engine = Engine(model, store, EngineSettings.of(history=False))
        hit = engine.generate(ids, GREEDY)
        engine.close()
    assert hit.hit_tiers == ("disk",) * stored
    assert hit.cached_tokens == stored * 256
