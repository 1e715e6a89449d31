"""An HTTP server as a child process: started in a process group of its own, ready once its health
URL answers 200, stopped by its PID (SIGTERM to the group, SIGKILL after a timeout), never by name.

``kvfuse serve`` has its own helper (``kvfuse_testkit.ServerProcess``, used as it is); vLLM and
llama-server use this one, since vLLM forks an engine-core process that must go with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from kvfuse_testkit import free_port


class ChildServer:
    """``cmd`` (with ``{port}`` filled in by ``build``) as a child process; a context manager."""

    name = "server"
    health_path = "/health"
    poll_s = 1.0  # between health checks

    def __init__(self, env: dict[str, str] | None = None, log_path: str | Path | None = None):
        self.port = free_port()
        self.env = {**os.environ, **(env or {})}
        self.cmd: list[str] = []
        self._tmp = tempfile.TemporaryDirectory(prefix=f"kvfuse-{self.name}-")
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / "server.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return self.url + "/v1"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server was not started"
        return self.proc.pid

    def check(self) -> None:
        """Raise if the server cannot start (a missing binary, venv or model)."""

    def start(self, timeout: float = 600.0, append_log: bool = False):
        self.check()
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab" if append_log else "wb") as log:
            # start_new_session: the server and whatever it forks share a process group whose id
            # is the server's PID, so stop() reaches all of them through that one PID.
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        self._wait_healthy(t0, timeout)
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float, timeout: float) -> None:
        import httpx

        while time.monotonic() < t0 + timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} during start-up "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not answer {self.health_path} within {timeout:.0f} s "
            f"(log {self.log_path}):\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the process group (its PID), SIGKILL after ``timeout``; the exit status."""
        if self.proc is None:
            return None
        pid = self.proc.pid
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self.proc.wait()
        # A forked child may outlive the server's exit by a moment: end what is left of the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            for _ in range(50):
                os.killpg(pid, 0)  # raises ProcessLookupError once the group is empty
                time.sleep(0.2)
            os.killpg(pid, signal.SIGKILL)
        return self.proc.returncode

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_has(self, text: str) -> bool:
        return text in self.log_tail(10**9)

    def log_lines(
        self, *needles: str, chars: int = 2_000_000, width: int | None = 300
    ) -> list[str]:
        """The log's lines that hold one of ``needles``, their ``[...]`` prefix cut, at most
        ``width`` characters each."""
        return [
            ln.split("]", 1)[-1].strip()[:width]
            for ln in self.log_tail(chars).splitlines()
            if any(n in ln for n in needles)
        ]

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
