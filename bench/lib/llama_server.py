"""llama.cpp's own OpenAI-compatible server, ``llama-server``, as a benchmark baseline: the server a
CPU user would otherwise pick, with its prompt cache on.

The binary comes from ``bash bench/setup_llama_server.sh`` (``.baselines/llama-server/bin``; built
from the llama.cpp source that llama-cpp-python 0.3.36's sdist vendors; ``$KVFUSE_LLAMA_SERVER``
or ``binary=`` point at another one). It serves a GGUF of the same model (``bench/lib/gguf.py``;
the benchmarks default to F32, exactly kvfuse's fp32 weights and vLLM's float32 ones). Started as

    llama-server --model <gguf> --alias smollm2 --host 127.0.0.1 --port <free port> \\
        --threads N --threads-batch N --ctx-size C --parallel P --kv-unified \\
        --cache-prompt --cache-reuse 256 --metrics --no-webui --slot-save-path <tmp> \\
        [--chat-template-file F]

- ``--threads`` / ``--threads-batch`` N: the same CPU threads as the others (all cores: kvfuse's
  and vLLM's default), for decode and for prompt processing;
- ``--ctx-size`` C: its KV cells, sized by the caller to the same KV RAM the others get (f16 KV,
  llama.cpp's default), shared by every slot (``--kv-unified``: one request may use all of it);
- ``--parallel`` P: one slot per concurrent client (continuous batching is on by default);
- the prompt cache: ``--cache-prompt`` (a slot reuses the longest common prefix of the prompt it
  holds; on by default, named for the record), ``--cache-reuse 256`` (also chunks of >= 256
  tokens found further on, moved into place by KV shifting; 256 = llama.cpp's own presets and
  kvfuse's chunk), and its host-RAM prompt cache (``--cache-ram``, default 8192 MiB: the prompts
  of slots that were reassigned, restored when a request matches them);
- ``--metrics``: its Prometheus counters; ``--no-webui``: no UI (the build has none);
  ``--slot-save-path`` (a temp folder): enables ``POST /slots/N?action=erase``, nothing else.

llama-server has no per-request ``cache_salt``, so a benchmark run that must start cold starts a
fresh server (``restart``; a few seconds for a small model), warms it up, then empties its slots
(``erase_slots``): the warm-up's short prompts could otherwise lend the run's first requests the
chat template's preamble. (Its host-RAM cache keeps what a warm-up slot handed over when it was
reassigned: prompts of a few tokens that share at most that preamble with a workload.)
"""

from __future__ import annotations

import os
from pathlib import Path

from .paths import BASELINES
from .proc import ChildServer

DEFAULT_BINARY = os.environ.get(
    "KVFUSE_LLAMA_SERVER", str(BASELINES / "llama-server" / "bin" / "llama-server")
)
CACHE_REUSE = 256


class LlamaServer(ChildServer):
    """``llama-server`` on one GGUF, its prompt cache on; see the module docstring for the flags."""

    name = "llama-server"
    poll_s = 0.2

    def __init__(
        self,
        gguf: str | Path,
        served_name: str = "smollm2",
        *,
        binary: str = DEFAULT_BINARY,
        threads: int | None = None,
        ctx_tokens: int = 65536,
        parallel: int = 1,
        chat_template: str | None = None,
        extra_args: list[str] | tuple = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ):
        super().__init__(env, log_path)
        self.gguf, self.binary = Path(gguf), binary
        n = str(threads or os.cpu_count() or 1)
        self.cmd = [
            *(binary, "--model", str(self.gguf), "--alias", served_name),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--threads", n, "--threads-batch", n),
            *("--ctx-size", str(ctx_tokens), "--parallel", str(parallel), "--kv-unified"),
            *("--cache-prompt", "--cache-reuse", str(CACHE_REUSE), "--metrics", "--no-webui"),
            *("--slot-save-path", self._tmp.name),
        ]
        self.parallel = parallel
        if chat_template:
            template = Path(self._tmp.name) / "chat_template.jinja"
            template.write_text(chat_template)
            self.cmd += ["--chat-template-file", str(template)]
        self.cmd += list(extra_args)

    def check(self) -> None:
        if not Path(self.binary).is_file():
            raise FileNotFoundError(
                f"{self.binary} not found: build it with bash bench/setup_llama_server.sh"
            )
        if not self.gguf.is_file():
            raise FileNotFoundError(f"{self.gguf} not found")

    def restart(self, timeout: float = 300.0) -> LlamaServer:
        """Stop and start again on the same port: every cache cold (slots and host RAM)."""
        self.stop()
        return self.start(timeout, append_log=True)

    def erase_slots(self) -> None:
        """Empty every slot's cached prompt (after a warm-up, so that its prompts are not reused)."""
        import httpx

        for i in range(self.parallel):
            r = httpx.post(f"{self.url}/slots/{i}", params={"action": "erase"}, timeout=60)
            r.raise_for_status()

    def version(self) -> str:
        """The build's ``--version`` line (``version: N (commit)``), or ``?``."""
        import subprocess

        try:
            out = subprocess.run(
                [self.binary, "--version"], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired):
            return "?"
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
        return lines[0].strip() if lines else "?"
