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
``bash bench/setup_vllm.sh``), pass ``kv_transfer_config=connector_config({...})``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .client import first_token  # noqa: F401  (the helpers tests/vllm and the scripts import here)
from .metrics import metric_total, scrape_metrics  # noqa: F401
from .paths import BASELINES
from .paths import model_folder as default_model_path  # noqa: F401
from .proc import ChildServer

DEFAULT_PYTHON = os.environ.get("KVFUSE_VLLM_PYTHON", str(BASELINES / "vllm-venv/bin/python"))

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


class VLLMServer(ChildServer):
    """vLLM's OpenAI API server as a child process in its own process group."""

    name = "vLLM"

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
        base = {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        super().__init__({**base, **(env or {})}, log_path)
        self.port = port or self.port
        self.model_path = Path(model_path)
        self.served_name = served_name
        self.python = python
        self.prefix_caching = prefix_caching
        self.cmd = [
            *(python, "-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(self.model_path), "--served-model-name", served_name),
            *("--dtype", dtype, "--max-model-len", str(max_model_len)),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            # on CPU this is the share of the machine's memory vLLM checks is free at start-up
            # (default 0.92: refused on a 24 GiB machine with ~2 GiB in use); the KV cache's
            # size is VLLM_CPU_KVCACHE_SPACE's
            *("--gpu-memory-utilization", "0.5"),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *extra_args,
        ]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]

    def check(self) -> None:
        if not Path(self.python).is_file():
            raise FileNotFoundError(
                f"{self.python} not found: create vLLM's venv with bash bench/setup_vllm.sh"
            )
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_path} is not an HF model folder (no config.json)")

    def prefix_caching_logged(self) -> bool:
        """Whether vLLM's start-up log says prefix caching is on."""
        return self.log_has("'enable_prefix_caching': True") or self.log_has(
            "enable_prefix_caching=True"
        )


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
