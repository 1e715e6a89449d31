"""The serving benchmarks' servers (bench/serve.py, bench/multiround.py): their flags, defined once,
and how each is started from them. Engines, run one at a time (never two at once):

- ``kvfuse``: ``kvfuse serve`` as a child process (``kvfuse_testkit.ServerProcess``), with the
  benchmark's config merged under ``--kvfuse-config`` and extra ``--kvfuse-arg`` flags;
- ``vllm``: vLLM's CPU build (``bench/lib/vllm.py``; venv from ``bench/setup_vllm.sh``) on the very
  same HF folder, float32, prefix caching on, set up as its CPU guide says (``--vllm-setup
  tuned``) or as installed (``default``);
- ``llama.cpp``: llama.cpp's ``llama-server`` (``bench/lib/llama_server.py``; binary from
  ``bench/setup_llama_server.sh``) on a GGUF of the same model (``--llama-gguf``, F32 by default:
  the same weights), the same thread count as the others, its prompt cache on.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

from .cli import cores, csv
from .gguf import PRECISIONS, chat_template, model_gguf
from .llama_server import DEFAULT_BINARY, LlamaServer
from .paths import default_home, model_folder

ENGINES = ("kvfuse", "vllm", "llama.cpp")
LABELS = {"vllm": "vLLM CPU (prefix caching on)", "llama.cpp": "llama.cpp server (prompt cache on)"}


def add_server_flags(p: argparse.ArgumentParser, name: str, default: str = "kvfuse,vllm") -> None:
    """The flags of the servers: which ones, and each one's set-up; ``name`` names the log folder."""
    p.add_argument(
        "--servers",
        "--engines",
        dest="servers",
        default=default,
        help=f"comma-separated, run in this order: {', '.join(ENGINES)} (default {default})",
    )
    p.add_argument("--home", default=str(default_home()), help="kvfuse home")
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--ignore-eos",
        choices=("auto", "on", "off"),
        default="auto",
        help="send ignore_eos: auto = only if every server accepts it (kvfuse's schema has it)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / f"kvfuse-bench-{name}",
        help=f"server logs (default: $TMPDIR/kvfuse-bench-{name})",
    )
    _kvfuse_flags(p)
    _vllm_flags(p)
    _llama_flags(p)


def _kvfuse_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kvfuse-config",
        type=Path,
        metavar="YAML",
        help="kvfuse: a config file merged over the benchmark's settings (e.g. engine batching keys)",
    )
    p.add_argument(
        "--kvfuse-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="kvfuse: extra `kvfuse serve` flags, shell-split, repeatable; write --kvfuse-arg='--threads 2'",
    )


def _vllm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vllm-python",
        default=None,
        help="vLLM's venv python (default .baselines/vllm-venv/bin/python or $KVFUSE_VLLM_PYTHON)",
    )
    p.add_argument(
        "--vllm-model-path",
        type=Path,
        help="the HF folder vLLM serves (default <home>/models/<model>)",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="vLLM: extra api_server flags, shell-split, repeatable",
    )
    p.add_argument(
        "--vllm-setup",
        choices=("tuned", "default"),
        default="tuned",
        help="vLLM CPU set-up: tuned (default; its CPU guide: tcmalloc and Intel OpenMP "
        "preloaded, no core reserved for HTTP: bench/lib/vllm.tuned_env) or default (as installed)",
    )
    p.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vLLM: extra environment, repeatable, over --vllm-setup's (as installed, vLLM CPU "
        "reserves one of the 2 cores for its API server and computes on the other)",
    )


def _llama_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--llama-server",
        default=DEFAULT_BINARY,
        help="llama.cpp: the llama-server binary (default .baselines/llama-server/bin/llama-server "
        "or $KVFUSE_LLAMA_SERVER; bash bench/setup_llama_server.sh builds it)",
    )
    p.add_argument(
        "--llama-gguf",
        default="f32",
        help=f"llama.cpp: the GGUF it serves: {', '.join(PRECISIONS)} (own: the model's shipped "
        "file; default f32: kvfuse's fp32 weights exactly), or a .gguf path",
    )
    p.add_argument(
        "--llama-threads",
        type=int,
        default=cores(),
        help="llama.cpp: --threads and --threads-batch (default: all cores, as kvfuse and vLLM use)",
    )
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="llama.cpp: extra llama-server flags, shell-split, repeatable",
    )


def servers(p: argparse.ArgumentParser, args) -> list[str]:
    """``--servers`` checked against ``ENGINES``."""
    names = csv(args.servers)
    for s in names:
        if s not in ENGINES:
            p.error(f"unknown server {s!r}: choose from {', '.join(ENGINES)}")
    return names


def split_args(values: list[str]) -> list[str]:
    return [a for s in values for a in shlex.split(s)]


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def kvfuse_process(args, config: dict[str, Any], log: Path, meta: dict):
    """``kvfuse serve`` with ``config`` (``--kvfuse-config`` merged over it) and ``--kvfuse-arg``."""
    import yaml

    from kvfuse_testkit import ServerProcess, ensure_model

    ensure_model(args.home, args.model)
    if args.kvfuse_config:
        config = deep_merge(config, yaml.safe_load(args.kvfuse_config.read_text()) or {})
    extra_args = split_args(args.kvfuse_arg)
    meta["kvfuse_config"], meta["kvfuse_args"] = config, extra_args
    return ServerProcess(args.home, config=config, args=extra_args, log_path=log)


def vllm_process(args, extra_args: list[str], log: Path, kv_cache_gib: float | None = None):
    """vLLM on the model's HF folder with ``--vllm-setup``'s environment, ``--vllm-env`` over it;
    without ``kv_cache_gib`` no ``VLLM_CPU_KVCACHE_SPACE`` (it would override
    ``--kv-cache-memory-bytes``) unless ``--vllm-env`` sets it. Returns (server, its env)."""
    from .vllm import DEFAULT_PYTHON, VLLMServer, tuned_env

    python = args.vllm_python or DEFAULT_PYTHON
    env = {
        **(tuned_env(python) if args.vllm_setup == "tuned" else {}),
        **dict(kv.split("=", 1) for kv in args.vllm_env),
    }
    srv = VLLMServer(
        args.vllm_model_path or model_folder(args.home, args.model),
        args.model,
        python=python,
        kv_cache_gib=kv_cache_gib or 4,
        extra_args=[*extra_args, *split_args(args.vllm_arg)],
        env=env,
        log_path=log,
    )
    if kv_cache_gib is None and "VLLM_CPU_KVCACHE_SPACE" not in env:
        srv.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return srv, env


def llama_process(args, ctx_tokens: int, parallel: int, log: Path) -> LlamaServer:
    """llama-server on ``--llama-gguf`` with ``--llama-threads``, ``ctx_tokens`` KV cells shared by
    ``parallel`` slots, its prompt cache on, ``--llama-arg`` after."""
    home = Path(args.home)
    gguf = Path(args.llama_gguf) if args.llama_gguf.endswith(".gguf") else None
    return LlamaServer(
        gguf or model_gguf(args.model, home, args.llama_gguf),
        args.model,
        binary=args.llama_server,
        threads=args.llama_threads,
        ctx_tokens=ctx_tokens,
        parallel=parallel,
        chat_template=chat_template(args.model),
        extra_args=split_args(args.llama_arg),
        log_path=log,
    )


def llama_meta(srv: LlamaServer, meta: dict) -> None:
    meta["llama_command"] = " ".join(srv.cmd)
    meta["llama_gguf"] = str(srv.gguf)
    meta["llama_startup_s"] = round(srv.startup_s or 0.0, 1)
    meta["llama_build"] = srv.version()


def require_ignore_eos(url: str, ignore_eos: bool, name: str) -> bool | None:
    """Whether the server's schema has ``ignore_eos`` (None: it publishes none); raises if a run
    that sends it would be ignored."""
    from .client import server_accepts

    accepts = server_accepts(url, "ignore_eos")
    if ignore_eos and accepts is False:
        raise RuntimeError(f"{name}'s schema has no ignore_eos; rerun with --ignore-eos off")
    return accepts


def kv_bytes_per_token(model_dir: Path, bytes_per_value: int) -> int:
    """K and V of one token over every layer, from the HF folder's config.json."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return c["num_hidden_layers"] * 2 * heads * head_dim * bytes_per_value


def log_path(args, name: str, engine: str) -> Path:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args.log_dir / f"{name}-{engine.replace('.', '')}.log"


def cpu_count() -> int | None:
    return os.cpu_count()
