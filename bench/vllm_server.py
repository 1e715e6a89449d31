"""vLLM's CPU build as a benchmark baseline: its OpenAI-compatible server as a child process.

vLLM is not a kvfuse dependency: it lives in its own virtual environment outside the repository
(``bash bench/setup_vllm.sh [VENV]``, default ``.baselines/vllm-venv``; ``$KVFUSE_VLLM_PYTHON`` or
``python=`` point at another one). ``VLLMServer`` starts

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 <venv>/bin/python -m vllm.entrypoints.openai.api_server \\
        --model <HF folder> --served-model-name smollm2 --dtype float32 --max-model-len 4096 \\
        --enable-prefix-caching --port <free port>

in a process group of its own (vLLM forks an engine-core process), logs to a file, waits for
``/health`` (start-up takes ~4 minutes on the 2-core benchmark machine, hence the 10-minute
default timeout) and stops the group by the PID it started (SIGTERM, then SIGKILL), never by name.
Memory: the model plus ``kv_cache_gib`` of KV; never run two of them on the 24 GiB machine.

    with vllm_server("/path/to/models/smollm2") as base_url:   # http://127.0.0.1:PORT/v1
        OpenAI(base_url=base_url, api_key="unused").completions.create(...)

With kvfuse's KV connector (``kvfuse.integrations.vllm``, installed into vLLM's venv by
``bash bench/setup_vllm.sh``), pass ``kv_transfer_config=connector_config({...})``; the
helpers below read the server's Prometheus metrics (``scrape_metrics``, ``metric_total``) and time
the first token of a streamed completion (``first_token``). ``bench/vllm_connector.py`` and
``tests/vllm`` use them.

``python bench/vllm_server.py`` is the smoke check: it starts the server, sends a greedy
completion and a greedy chat completion with the ``openai`` client, and prints them and the
start-up time (``--connector`` adds kvfuse's connector, with its disk tier in a temp folder).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvfuse_testkit import free_port

DEFAULT_PYTHON = os.environ.get("KVFUSE_VLLM_PYTHON", str(REPO / ".baselines/vllm-venv/bin/python"))


TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


def tuned_env(python: str | Path = DEFAULT_PYTHON) -> dict[str, str]:
    """vLLM's CPU set-up guide as environment: tcmalloc (``apt-get install libtcmalloc-minimal4``)
    and the venv's Intel OpenMP preloaded where present, and no core reserved for the HTTP server
    (its default keeps one of a 2-core machine's cores out of the model). Measured on the 2-core VM
    (docs/benchmarks.md): 104 vs 60.5 tok/s at 16 clients; the fair baseline for a speed claim."""
    lib = Path(python).parent.parent / "lib"  # the venv's, not its base interpreter's
    preload = [
        p
        for p in (next((t for t in TCMALLOC if Path(t).is_file()), None), lib / "libiomp5.so")
        if p is not None and Path(p).is_file()
    ]
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if preload:
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return env


def default_model_path(home: str | Path | None = None, model: str = "smollm2") -> Path:
    """The HF-style folder kvfuse converted ``model`` into (``<home>/models/<model>``): the very same
    weights, tokenizer and chat template kvfuse serves."""
    home = Path(home or os.environ.get("KVFUSE_HOME") or Path.home() / ".cache" / "kvfuse")
    return home / "models" / model


class VLLMServer:
    """vLLM's OpenAI API server as a child process in its own process group."""

    def __init__(
        self,
        model_path: str | Path,
        served_name: str = "smollm2",
        *,
        python: str = DEFAULT_PYTHON,
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 4096,
        kv_cache_gib: float = 4,
        prefix_caching: bool = True,
        extra_args: list[str] | tuple = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        kv_transfer_config: dict[str, Any] | None = None,
    ):
        self.model_path = Path(model_path)
        self.served_name = served_name
        self.python = python
        self.port = port or free_port()
        self.prefix_caching = prefix_caching
        self.cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_path),
            "--served-model-name",
            served_name,
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra_args,
        ]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **(env or {}),
        }
        self._tmp = tempfile.TemporaryDirectory(prefix="kvfuse-vllm-") if log_path is None else None
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / "vllm.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return self.url + "/v1"

    def start(self, timeout: float = 600.0) -> VLLMServer:
        import httpx

        if not Path(self.python).is_file():
            raise FileNotFoundError(
                f"{self.python} not found: create vLLM's venv with bash bench/setup_vllm.sh"
            )
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_path} is not an HF model folder (no config.json)")
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # start_new_session: the server and the engine-core process it forks get a process group
            # whose id is the server's PID, so stop() reaches both through that one PID.
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with status {self.proc.returncode} during start-up "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"vLLM did not answer /health within {timeout:.0f} s (log {self.log_path}):\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the server's process group (its PID), SIGKILL after ``timeout``; the exit status."""
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
        # The engine-core child may outlive the server's exit by a moment: end what is left of the group.
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
        try:
            return text in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> VLLMServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def connector_config(
    extra: dict[str, Any] | None = None, failure_policy: str = "recompute"
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvfuse's connector, with ``extra`` as its
    ``kv_connector_extra_config`` (``disk_path``, ``redis_url``, ``chunk_size``, ...; docs/vllm.md)."""
    return {
        "kv_connector": "KvfuseConnector",
        "kv_connector_module_path": "kvfuse.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": dict(extra or {}),
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape_metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus ``/metrics`` page: ``(name, labels, value)``."""
    import httpx

    out = []
    for line in httpx.get(url.rstrip("/") + "/metrics", timeout=10.0).text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric_total(
    samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str
) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def first_token(
    base_url: str,
    prompt: list[int] | str,
    max_tokens: int = 16,
    model: str = "smollm2",
    timeout: float = 600.0,
) -> tuple[float, str, dict[str, Any]]:
    """Send a greedy streamed completion; (seconds to the first token, the whole text, usage)."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with httpx.stream(
        "POST", base_url.rstrip("/") + "/completions", json=body, timeout=timeout
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(choice["text"])
            usage = event.get("usage") or usage
    if ttft is None:
        raise RuntimeError("the completion streamed no text")
    return ttft, "".join(text), usage


@contextlib.contextmanager
def vllm_server(
    model_path: str | Path, served_name: str = "smollm2", timeout: float = 600.0, **kw
) -> Iterator[str]:
    """Start vLLM (see ``VLLMServer`` for the options), yield its OpenAI base URL, stop it at exit."""
    server = VLLMServer(model_path, served_name, **kw)
    try:
        server.start(timeout)
        yield server.base_url
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        description="Start vLLM CPU on kvfuse's model folder, check it with the openai client, stop it."
    )
    p.add_argument("--model-path", type=Path, default=default_model_path())
    p.add_argument("--python", default=DEFAULT_PYTHON)
    p.add_argument("--log", type=Path, help="server log (default: a temp file)")
    p.add_argument(
        "--connector",
        action="store_true",
        help="with kvfuse's KV connector (disk tier in a temp folder)",
    )
    args = p.parse_args(argv)
    from openai import OpenAI

    kv_dir = tempfile.TemporaryDirectory(prefix="kvfuse-vllm-kv-") if args.connector else None
    server = VLLMServer(
        args.model_path,
        python=args.python,
        log_path=args.log,
        kv_transfer_config=connector_config({"disk_path": kv_dir.name}) if kv_dir else None,
    )
    print(f"starting: {' '.join(server.cmd)}\nlog: {server.log_path}", file=sys.stderr)
    with server:
        print(
            f"healthy after {server.startup_s:.0f} s at {server.base_url} (pid {server.proc.pid})",
            file=sys.stderr,
        )
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        print("models:", [m.id for m in client.models.list().data])
        r = client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=16, temperature=0
        )
        print("completion:", repr(r.choices[0].text), r.usage)
        c = client.chat.completions.create(
            model="smollm2",
            max_tokens=32,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        print("chat:", repr(c.choices[0].message.content), c.usage)
        for line in server.log_tail(200_000).splitlines():
            if "prefix_caching" in line or "prefix caching" in line.lower() or "kvfuse" in line:
                print("log:", line.strip()[:300], file=sys.stderr)
    if kv_dir is not None:
        kv_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
