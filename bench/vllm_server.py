"""Smoke check of vLLM's CPU build on kvfuse's model folder: start its OpenAI server
(``bench/lib/vllm.py``, venv from ``bash bench/setup_vllm.sh``), send a greedy completion and a
greedy chat completion with the ``openai`` client, print them and the start-up time, stop it
(``--connector`` adds kvfuse's KV connector, with its disk tier in a temp folder).

    python bench/vllm_server.py [--model-path DIR] [--python VENV/bin/python] [--connector]

The server helpers themselves (``VLLMServer``, ``connector_config``, ``tuned_env``, ...) live in
``bench/lib/vllm.py``; tests/vllm and bench/vllm_connector.py import them from there.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.vllm import DEFAULT_PYTHON, VLLMServer, connector_config, default_model_path


def ask(server: VLLMServer) -> None:
    """A completion and a chat completion, greedy, through the openai client."""
    from openai import OpenAI

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
            f"healthy after {server.startup_s:.0f} s at {server.base_url} (pid {server.pid})",
            file=sys.stderr,
        )
        ask(server)
        for line in server.log_tail(200_000).splitlines():
            if "prefix_caching" in line or "prefix caching" in line.lower() or "kvfuse" in line:
                print("log:", line.strip()[:300], file=sys.stderr)
    if kv_dir is not None:
        kv_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
