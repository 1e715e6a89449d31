"""What the interop tests with real KV-event consumers (vLLM's decoder, vllm-router, Dynamo's
indexer, each in a venv of its own) share: a kvfuse server publishing KV events, the consumer's
executable or a skip naming its set-up script, and a wait for the consumer's HTTP side."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from . import ServerProcess, free_port


def events_server(home, folder: Path, name: str, model: str) -> ServerProcess:
    """A server (not started) with its disk tier and log under ``folder`` and ``--kv-events`` on a
    free port, whose address is its ``events_url``."""
    port = free_port()
    srv = ServerProcess(
        home,
        config={"model": model, "cache": {"disk_path": str(folder / name)}},
        args=["--kv-events", f"tcp://127.0.0.1:{port}"],
        log_path=folder / f"{name}.log",  # kept with the test's files, for a failure's story
    )
    srv.events_url = f"tcp://127.0.0.1:{port}"
    return srv


def consumer(path: str, what: str, setup: str, variable: str) -> str:
    """``path`` if it is a file; else the test is skipped, saying how to make it."""
    import pytest

    if not Path(path).is_file():
        pytest.skip(f"no {what} at {path}: bash {setup} (or {variable})")
    return path


def wait_ready(url: str, proc: subprocess.Popen, log: Path, what: str, timeout: float = 60.0):
    """Wait until ``GET url`` answers 200; raises with the end of ``log`` if ``proc`` exits or the
    time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not start: {log.read_text()[-3000:]}")
