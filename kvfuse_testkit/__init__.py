"""Helpers for kvfuse's tests and benchmarks: free ports, a throwaway redis-server, a local
S3-compatible server (moto), a ``kvfuse serve`` child process. A package of its own, beside
``kvfuse`` (installed with it from this repository): kvfuse itself never imports it.

Processes started here are ended by their PID (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- redis
def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """A redis-server subprocess on a free 127.0.0.1 port; ``stop()`` kills it by PID, ``start()``
    (re)starts it on the same port. Not a production deployment: no persistence (``--save ""
    --appendonly no``), loopback only."""

    def __init__(self, executable: str | None = None, port: int | None = None) -> None:
        executable = executable or shutil.which("redis-server")
        if executable is None:
            raise FileNotFoundError(
                "redis-server is not installed: apt-get install -y redis-server"
            )
        self.executable = executable
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        """redis-server's command line (a subclass adds TLS and ACL settings)."""
        return [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]

    def _ready(self) -> bool:
        return _ping(self.port)

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"redis-server did not answer PING on port {self.port} within {timeout_s}s"
                )
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port p below 55536 whose cluster-bus port p + 10000 is free too."""
    for _ in range(200):
        with (
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a,
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b,
        ):
            port = random.randint(20000, 55000)
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a Redis cluster node")


class LocalRedisCluster:
    """A Redis Cluster of ``nodes`` redis-server processes (primaries only) on free 127.0.0.1 ports,
    in a temporary folder, created with ``redis-cli --cluster create``; ``stop()`` kills them by PID."""

    def __init__(self, nodes: int = 3) -> None:
        # A cluster node also listens on its port + 10000 (the cluster bus): both must be free.
        self.servers = [LocalRedis(port=_cluster_port()) for _ in range(nodes)]
        self._tmp = tempfile.TemporaryDirectory(prefix="kvfuse-redis-cluster-")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError(
                "redis-cli is not installed: apt-get install -y redis-server (it ships redis-cli)"
            )
        self.cli = cli

    @property
    def url(self) -> str:
        """The URL of the first node (any node's URL reaches the whole cluster)."""
        return self.servers[0].url

    def start(self, timeout_s: float = 90.0) -> LocalRedisCluster:
        for i, s in enumerate(self.servers):
            folder = Path(self._tmp.name) / str(i)
            folder.mkdir(exist_ok=True)
            s.proc = subprocess.Popen(
                [
                    s.executable,
                    "--port",
                    str(s.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(folder / "nodes.conf"),
                    "--dir",
                    str(folder),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while not all(_ping(s.port) for s in self.servers):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the cluster's redis-servers did not start")
            time.sleep(0.05)
        subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{s.port}" for s in self.servers],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        while True:
            info = subprocess.run(
                [self.cli, "-p", str(self.servers[0].port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            if "cluster_state:ok" in info:
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Redis cluster did not become ready:\n{info}")
            time.sleep(0.1)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------ S3 (moto)

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}  # dummy keys; no SDK call reaches for the cloud


class LocalS3:
    """``moto_server`` (an S3-compatible server) on a free 127.0.0.1 port, in memory; ``stop()``
    kills it by PID (its objects are lost), ``start()`` (re)starts it on the same port. Set the
    ``S3_ENV`` variables in the clients' environment (``os.environ.update(S3_ENV)``)."""

    def __init__(self, port: int | None = None) -> None:
        exe = Path(sys.executable).with_name("moto_server")
        if not exe.exists():
            found = shutil.which("moto_server")
            if found is None:
                raise FileNotFoundError("moto_server is not installed: pip install 'moto[server]'")
            exe = Path(found)
        self.executable = str(exe)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> LocalS3:
        import httpx

        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            [self.executable, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **S3_ENV},
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {self.proc.returncode} (port {self.port} taken?)"
                )
            try:
                httpx.get(self.endpoint_url + "/moto-api/", timeout=1.0)
                return self
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto_server did not answer on port {self.port} within {timeout_s}s"
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------ kvfuse serve


class ServerProcess:
    """``python -m kvfuse.cli serve`` with a YAML config built from ``config`` (nested dicts as in the
    config file) and extra CLI ``args``; its stderr goes to ``log_path`` (a temp file by default)."""

    def __init__(
        self,
        home: str | Path,
        config: dict[str, Any] | None = None,
        args: list[str] | tuple = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        port: int | None = None,
    ):
        self.home = Path(home)
        self.port = port or free_port()
        self.config = config or {}
        self.args = list(args)
        self.env = env
        self._tmp = tempfile.TemporaryDirectory(prefix="kvfuse-serve-")
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / "server.log"
        self.proc: subprocess.Popen | None = None

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

    def start(self, timeout: float = 180.0) -> ServerProcess:
        import httpx  # a test/benchmark dependency, not one of the server's

        config_path = Path(self._tmp.name) / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.config))
        cmd = [
            sys.executable,
            "-m",
            "kvfuse.cli",
            "serve",
            "--port",
            str(self.port),
            "--home",
            str(self.home),
            "--config",
            str(config_path),
            *self.args,
        ]
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvfuse serve exited with status {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(
            f"kvfuse serve did not answer /health within {timeout:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``sig`` to the process and wait for it (SIGKILL after ``timeout``); its exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.kill(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def ensure_model(home: str | Path, model: str = "smollm2") -> None:
    """Convert built-in ``model`` into ``home`` unless it is there already (once, before any server
    starts, so that concurrent servers never convert at the same time)."""
    from kvfuse.models import registry

    if (
        model in registry.BUILTIN
        and not (registry.converted_dir(Path(home), model) / registry.MANIFEST).is_file()
    ):
        subprocess.run(
            [sys.executable, "-m", "kvfuse.cli", "models", "pull", model, "--home", str(home)],
            check=True,
        )
