"""``kvfuse`` command line: models | generate | chat | serve | precompute | cache | responses | keys.

Every command reads the configuration as ``defaults < --config FILE < KVFUSE_* env < flags``.
User errors (a wrong model name, a bad flag value, a missing package) print one line naming
the fix and exit with status 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from . import __version__
from .config import WEIGHT_FORMATS, Config, load_from_environment

log = logging.getLogger("kvfuse")


class UserError(Exception):
    """Reported as ``kvfuse: error: ...`` with exit status 2."""


# ----------------------------------------------------------------------------------- parsing


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _ratio_number(text: str) -> float:
    try:
        r = float(text)
    except ValueError:
        r = -1.0
    if not 0.0 <= r <= 1.0:
        raise UserError(f"a recompute budget must be a number in [0, 1], got {text!r}")
    return r


def _ratio(text: str) -> float | str:
    """--recompute-ratio: a number in [0, 1], or auto."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _ratio_number(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(f"{e}, or auto") from None


def _blend_text(blend) -> str:
    if not blend.blends:
        return f"documents not blended (reused as an exact prefix; from the {blend.source}), "
    return f"blend {blend.method} at {blend.recompute_ratio:g} (from the {blend.source}), "


def _common(p: argparse.ArgumentParser, model: bool = True) -> None:
    p.add_argument(
        "--config", metavar="FILE", help="YAML configuration file (default: $KVFUSE_CONFIG)"
    )
    p.add_argument(
        "--home",
        metavar="DIR",
        help="kvfuse home: converted models, disk cache (default: ~/.cache/kvfuse)",
    )
    if model:
        p.add_argument(
            "--model",
            metavar="NAME|PATH",
            help="built-in name (kvfuse models list), HF folder or .gguf file",
        )
        p.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
        p.add_argument(
            "--dtype",
            help="compute dtype: auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16",
        )
        p.add_argument(
            "--weights",
            choices=WEIGHT_FORMATS,
            help="weight format: auto (default: a GGUF file's own blocks on CPU, else the compute "
            "dtype), fp32 (dequantized to the compute dtype) or int8 (CPU only, lossy; its KV is "
            "cached apart from full-precision KV)",
        )
        p.add_argument(
            "--kernels",
            choices=("auto", "on", "off"),
            help="kvfuse's CPU kernels: auto (where they build, default), on (required: an error "
            "where they cannot run) or off (PyTorch's operators only, for measurements)",
        )
        p.add_argument("--threads", type=int, help="CPU threads for PyTorch (default: all cores)")
        p.add_argument(
            "--retention",
            metavar="in_memory|DURATION",
            help="how long the KV entries written stay: in_memory (memory tier only) or a duration such "
            "as 24h (every tier, then expired); default: cache.retention (until evicted)",
        )
        p.add_argument(
            "--kv-slo-ms",
            type=float,
            metavar="MS",
            help="load KV from disk / Redis within this budget, each chunk at the best encoding that "
            "fits or recomputed (CacheGen streaming; cache.kv_slo_ms)",
        )
        p.add_argument(
            "--blend-auto",
            choices=("on", "off"),
            help="automatic reuse: find cached passages inside plain prompts, at any position, and "
            "blend them with the model's calibrated budget (blend.auto; default off)",
        )
    p.add_argument(
        "--redis-url", metavar="URL", help="add a Redis/Valkey tier, e.g. redis://127.0.0.1:6379/0"
    )
    p.add_argument("--no-disk", action="store_true", help="no disk tier")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log progress and timings to stderr"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvfuse`` parser: one subcommand per command, each declared by its own function below
    (in the order ``kvfuse --help`` lists them)."""
    parser = argparse.ArgumentParser(prog="kvfuse", description="KV-cache engine for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvfuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _models_parser(sub)
    _generate_parser(sub)
    _chat_parser(sub)
    _precompute_parser(sub)
    _calibrate_parser(sub)
    _serve_parser(sub)
    _cache_parser(sub)
    _responses_parser(sub)
    _keys_parser(sub)
    return parser


def _models_parser(sub) -> None:
    """``kvfuse models list | pull``: the built-in models."""
    models = sub.add_parser("models", help="list or pull the built-in models")
    msub = models.add_subparsers(dest="action", metavar="ACTION")
    msub.required = True
    p = msub.add_parser("list", help="built-in models and whether they are installed / converted")
    _common(p, model=False)
    p = msub.add_parser(
        "pull",
        help="fetch (if needed) and convert a built-in model once into the kvfuse home, "
        "showing each step's progress on stderr",
    )
    p.add_argument("name")
    p.add_argument(
        "--force", action="store_true", help="convert again even if a valid conversion exists"
    )
    _common(p, model=False)


def _generate_parser(sub) -> None:
    """``kvfuse generate``: one prompt, its sampling and its documents."""
    p = sub.add_parser("generate", help="generate an answer to a prompt (reusing cached KV)")
    p.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the KV cache")
    p.add_argument(
        "--document",
        action="append",
        default=[],
        metavar="FILE",
        help='a document placed before the prompt (a .txt file, or a .jsonl file of {"text": ...} '
        "lines); its KV is cached on its own and blended (repeatable)",
    )
    p.add_argument(
        "--recompute-ratio",
        type=_ratio,
        metavar="R",
        help="fraction of document tokens recomputed in context, 0..1, or auto (the model's calibrated "
        "budget; default: blend.recompute_ratio)",
    )
    _common(p)


def _chat_parser(sub) -> None:
    """``kvfuse chat``: a conversation on stdin, and what happens beyond the context window."""
    p = sub.add_parser(
        "chat",
        help="a multi-turn conversation: one user turn per line of stdin, the whole history "
        "reused turn after turn",
    )
    p.add_argument("--system", help="system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--truncation",
        choices=("reuse", "recompute", "off"),
        help="a conversation beyond the context window: drop its oldest turns and reuse the rest's KV at "
        "their new positions, or recompute it, or stop (default: cache.truncation)",
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        metavar="N",
        help="the context window in tokens (default: the model's)",
    )
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the KV cache")
    _common(p)


def _precompute_parser(sub) -> None:
    """``kvfuse precompute``: documents whose KV is cached ahead of requests."""
    p = sub.add_parser(
        "precompute", help="compute and cache documents' KV ahead of requests that use them"
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="FILE|DIR",
        help='.txt files (one document each), .jsonl files (one {"text": ...} per line), or folders of them',
    )
    p.add_argument(
        "--tenant", default="", help="the tenant whose requests will use them (its API key's name)"
    )
    p.add_argument("--cache-salt", default="", help="the cache_salt the requests will send")
    _common(p)


def _calibrate_parser(sub) -> None:
    """``kvfuse calibrate``: the blend grid and the CacheGen levels measured for a profile."""
    p = sub.add_parser(
        "calibrate",
        help="measure how much recomputation keeps a model's answers when blending "
        "documents (recompute_ratio: auto) and which CacheGen level keeps its "
        "predictions (codec_level: 0), and store its profile",
    )
    p.add_argument(
        "calibrate_model",
        nargs="?",
        metavar="MODEL",
        help="the model (default: --model or the configuration's)",
    )
    p.add_argument(
        "--part",
        choices=("blend", "codec", "all"),
        default="all",
        help="what is measured: the blend budget, the default CacheGen level, or both (default); the part "
        "not measured is kept from the model's current profile",
    )
    p.add_argument(
        "--items",
        type=_positive,
        default=260,
        help="dev examples measured, taken in turn from the sources, each in one prompt form "
        "(default 260: every dev example of the three sources)",
    )
    _calibration_item_options(p)
    _calibration_grid_options(p)
    p.add_argument(
        "--codec-items",
        type=_positive,
        default=6,
        help="fictional QA dev items (12 documents each) the CacheGen levels are measured on (default 6)",
    )
    p.add_argument(
        "--output",
        metavar="FILE",
        help="write the profile here (default: <home>/profiles/<fingerprint>.json, where auto finds it)",
    )
    _common(p)


def _calibration_grid_options(p) -> None:
    """``kvfuse calibrate``'s blend grid (methods, budgets, document contexts) and how much of it
    is run (``--measure-all``)."""
    p.add_argument(
        "--methods",
        default="hkvd,sinks+hkvd",
        help="selection methods tried (default hkvd,sinks+hkvd)",
    )
    p.add_argument(
        "--ratios",
        default="0.05,0.1,0.15,0.3,0.6",
        help="recompute budgets tried (default 0.05,0.1,0.15,0.3,0.6)",
    )
    p.add_argument(
        "--contexts",
        help="document contexts tried (bos, eos, prefix, none; default: bos, and prefix "
        "too for a chat model, whose documents follow a system prompt)",
    )
    p.add_argument(
        "--measure-all",
        action="store_true",
        help="run every setting on every item, without early elimination (the same choice; the "
        "figures of settings that cannot be chosen, at the full grid's cost)",
    )


def _calibration_item_options(p) -> None:
    """``kvfuse calibrate``'s items: sources, prompt forms, passages, holdout, confidence."""
    p.add_argument(
        "--sources",
        help="where the questions come from: fictional, musique (dev 0-49), cacheblend "
        "(default: all three, those whose data is in $KVFUSE_DATA or ../shared/data)",
    )
    p.add_argument(
        "--forms",
        help="prompt forms: chat, completion, labeled, unlabeled, first, middle, last (where the "
        "answer's passage goes); an axis not named keeps all its values (default: all; chat only "
        "for a chat model)",
    )
    p.add_argument(
        "--documents", default="4-10", help="passages per prompt, N or MIN-MAX (default 4-10)"
    )
    p.add_argument(
        "--holdout",
        type=float,
        default=0.4,
        metavar="FRACTION",
        help="fraction of the examples held out from the choice and used to check it (default 0.4)",
    )
    p.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="of the one-sided lower bound of answers kept the choice is made on (default 0.95)",
    )


def _serve_parser(sub) -> None:
    """``kvfuse serve``: the HTTP server's address, API keys and batching limits."""
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument(
        "--api-key", action="append", metavar="KEY:TENANT", help="require this API key (repeatable)"
    )
    p.add_argument("--no-cache", action="store_true", help="serve without any KV cache")
    p.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        help="sequences batched together in each step (engine.max_running, default 32)",
    )
    p.add_argument(
        "--kv-memory",
        metavar="SIZE",
        help="live KV of all running sequences together, e.g. 2GiB (engine.kv_memory_bytes; "
        "default 4GiB)",
    )
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish KV events in vLLM's format for cache-aware routers on this ZMQ endpoint, "
        "e.g. tcp://*:5557 (server.kv_events; off by default; docs/routers.md)",
    )
    _common(p)


def _cache_parser(sub) -> None:
    """``kvfuse cache stats | clear | inspect``: the KV cache tiers."""
    cache = sub.add_parser("cache", help="inspect or clear the KV cache tiers")
    csub = cache.add_subparsers(dest="action", metavar="ACTION")
    csub.required = True
    p = csub.add_parser("stats", help="entries and bytes per tier")
    p.add_argument("--json", action="store_true")
    _common(p, model=False)
    p = csub.add_parser("clear", help="delete cached entries")
    p.add_argument(
        "--tier",
        default="all",
        metavar="NAME",
        help="clear one tier below memory, by name (disk, redis, s3, or a cache.tiers name); default all",
    )
    p.add_argument(
        "--prefix", default="", help="only keys starting with this (a namespace id, e.g. 3f2a...:)"
    )
    _common(p, model=False)
    p = csub.add_parser(
        "inspect",
        help="list entries with codec, level and compression ratio, or show one "
        "entry's header (a storage key or an entry file)",
    )
    p.add_argument(
        "target",
        metavar="KEY|FILE",
        nargs="?",
        help="one entry; without it, list the disk and Redis tiers",
    )
    p.add_argument("--limit", type=int, default=50, help="entries listed per tier (default 50)")
    p.add_argument("--json", action="store_true", help="the list as JSON")
    _common(p, model=False)


def _responses_parser(sub) -> None:
    """``kvfuse responses list | show | delete | purge``: the stored responses."""
    responses = sub.add_parser(
        "responses", help="list, show, delete or purge the Responses API's stored responses"
    )
    rsub = responses.add_subparsers(dest="action", metavar="ACTION")
    rsub.required = True
    p = rsub.add_parser("list", help="the newest stored responses")
    p.add_argument("--tenant", help="only this tenant's (its API key's name; '' without API keys)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true")
    _common(p, model=False)
    p = rsub.add_parser("show", help="one stored response as JSON")
    p.add_argument("id")
    p.add_argument("--tenant", default="", help="the tenant that created it ('' without API keys)")
    _common(p, model=False)
    p = rsub.add_parser("delete", help="delete a stored response and free its KV entries")
    p.add_argument("id")
    p.add_argument("--tenant", default="", help="the tenant that created it ('' without API keys)")
    _common(p, model=False)
    p = rsub.add_parser(
        "purge", help="delete the expired responses (responses.ttl) and free their KV entries"
    )
    _common(p, model=False)


def _keys_parser(sub) -> None:
    """``kvfuse keys digest``: the digest of an API key, to configure in its place."""
    keys = sub.add_parser("keys", help="API keys: print the digest to configure instead of a key")
    ksub = keys.add_subparsers(dest="action", metavar="ACTION")
    ksub.required = True
    p = ksub.add_parser(
        "digest",
        help="print sha256:<hex> of an API key (or the metrics token), for server.api_keys "
        "(sha256:<hex>:TENANT) or server.metrics_token; the key is read from stdin "
        "unless given (an argument stays in the shell's history)",
    )
    p.add_argument("key", nargs="?", metavar="KEY", help="the key (default: one line of stdin)")
    p.add_argument(
        "--tenant", metavar="NAME", help="print the whole server.api_keys entry, sha256:<hex>:NAME"
    )
    p.set_defaults(verbose=False)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = {
        "home": getattr(args, "home", None),
        "model": getattr(args, "calibrate_model", None) or getattr(args, "model", None),
        "device": getattr(args, "device", None),
        "dtype": getattr(args, "dtype", None),
        "weights": getattr(args, "weights", None),
        "kernels": getattr(args, "kernels", None),
        "threads": getattr(args, "threads", None),
        "cache.redis_url": getattr(args, "redis_url", None),
        "cache.disk": False if getattr(args, "no_disk", False) else None,
        "cache.enabled": False if getattr(args, "no_cache", False) else None,
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
        "server.api_keys": tuple(args.api_key) if getattr(args, "api_key", None) else None,
        "cache.truncation": getattr(args, "truncation", None),
        "context_tokens": getattr(args, "context_tokens", None),
        "cache.kv_slo_ms": getattr(args, "kv_slo_ms", None),
        "blend.auto": getattr(args, "blend_auto", None),
        "cache.retention": getattr(args, "retention", None),
        "engine.max_running": getattr(args, "max_running", None),
        "engine.kv_memory_bytes": getattr(args, "kv_memory", None),
        "server.kv_events": getattr(args, "kv_events", None),
    }
    return load_from_environment(getattr(args, "config", None), overrides)


# ---------------------------------------------------------------------------------- commands


def cmd_models(args, config: Config) -> int:
    from .models import registry

    home = config.home_path
    if args.action == "list":
        rows = []
        for m in registry.BUILTIN.values():
            installed = registry.package_installed(m)
            converted = (registry.converted_dir(home, m.name) / registry.MANIFEST).is_file()
            if converted or installed:
                state = "ready" if converted else "installed"
            else:
                state = (
                    f"{'not downloaded' if m.split is not None else 'missing'}: {m.install_hint()}"
                )
            rows.append((m.name, state, m.description))
        width = max(len(r[0]) for r in rows)
        swidth = max(len(r[1]) for r in rows)
        for name, state, desc in rows:
            print(f"{name:<{width}}  {state:<{swidth}}  {desc}")
        from .models.cpu import kernels

        print(f"\nCPU backend: {_backend_line(config)}")
        print(f"CPU: {kernels.cpu_line()}")
        return 0
    folder = registry.pull(args.name, home, force=args.force)
    print(folder)
    return 0


def _backend_line(config: Config) -> str:
    """The CPU path a model loaded with this configuration would run on (``models list``), without
    compiling the kernels for it: a listing must not take the two minutes of a first build."""
    from .models import resolve_device, resolve_dtype
    from .models.cpu import backend, kernels

    int8_on_cpu = config.weights == "int8" and config.device == "auto"  # as load_model does
    device = resolve_device("cpu" if int8_on_cpu else config.device)
    if config.kernels != "off" and device.type == "cpu" and not kernels.built():
        return (
            f"kernels not built yet (kernels: {config.kernels}): the first model load builds them "
            "(about two minutes), or python -m kvfuse.models.cpu.kernels now"
        )
    dtype = resolve_dtype(config.dtype, device)
    try:
        chosen = backend.select(config.kernels, device, dtype, config.weights)
    except backend.KernelsUnavailable as e:
        return f"unavailable: {e}"
    line = f"{chosen.describe()} (device {device}, {str(dtype).removeprefix('torch.')})"
    if config.weights == "auto" and chosen.ggml:  # what load_folder does with a GGUF
        line = line.replace(
            "weights blocked-fp32",
            "weights ggml (a folder's model.gguf blocks; blocked-fp32 without one)",
        )
    return line


def cmd_generate(args, config: Config) -> int:
    from .generation import SamplingParams
    from .runtime import open_serving

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    documents = [doc for path in args.document for doc in read_documents(Path(path))]
    if args.recompute_ratio is not None and not documents:
        raise UserError("--recompute-ratio applies to prompts with --document")
    if documents and args.no_cache:
        raise UserError("--document needs the KV cache: remove --no-cache")
    serving = open_serving(config)
    engine = serving.engine
    try:
        ids = _generate_prompt(args, serving.prompts, prompt, documents)

        def write(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = engine.generate(ids, params, on_text=write, recompute_ratio=args.recompute_ratio)
        sys.stdout.write("\n")
        if args.verbose:
            _report_generation(result, bool(documents))
    finally:
        engine.close()  # flushes the background writes to disk / Redis
    return 0


def _generate_prompt(args, prompts, prompt: str, documents: list[str]):
    """What ``kvfuse generate`` runs: the prompt as given or (``--chat``) as a user turn in the chat
    template; after the documents, when there are some, as a ``Prompt`` that marks their spans (each
    document's KV is cached on its own and blended), else as token ids."""
    messages = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
    if documents:
        return prompts.document_prompt(
            documents, prompt=None if args.chat else prompt, messages=messages
        )
    return prompts.encode_prompt(messages=messages) if args.chat else prompts.encode_prompt(prompt)


def _report_generation(result, documents: bool) -> None:
    """``kvfuse generate -v``: where the prompt's KV came from and the timings, on stderr (stdout
    holds only the answer, so that it can be piped)."""
    t = result.timings
    print(
        f"[kvfuse] prompt {result.prompt_tokens} tokens ({result.cached_tokens} cached"
        f"{' from ' + ','.join(sorted(set(result.hit_tiers))) if result.hit_tiers else ''}"
        f"{f', {result.recomputed_tokens} document tokens recomputed' if documents else ''}), "
        f"{_blend_text(result.blend) if result.blend is not None else ''}"
        f"{result.completion_tokens} generated, finish={result.finish_reason}\n"
        f"[kvfuse] time to first token {t.ttft_s * 1000:.0f} ms (load {t.load_s * 1000:.0f} ms, "
        f"prefill {t.prefill_s * 1000:.0f} ms), decode {t.decode_tokens_per_s(result.completion_tokens):.1f} tokens/s",
        file=sys.stderr,
    )
    if result.kv_stream is not None:
        r = result.kv_stream
        chunks = ", ".join(f"{n} {enc}" for enc, n in sorted(r.chunks.items()))
        print(
            f"[kvfuse] streamed from slow tiers: {chunks}; {r.load_s * 1000:.0f} ms of a "
            f"{r.slo_s * 1000:.0f} ms budget ({r.bytes_read / 2**20:.1f} MiB read)",
            file=sys.stderr,
        )


def cmd_chat(args, config: Config) -> int:
    from kvfuse.prompts.truncate import without_oldest

    from .generation import SamplingParams
    from .runtime import open_serving

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    serving = open_serving(config)
    engine = serving.engine
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            ids, dropped = serving.prompts.encode_chat(messages, reserve=params.max_tokens)
            if dropped:  # the next turns go on from what is left
                messages = without_oldest(messages, dropped)
            result = engine.generate(
                ids, params, on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush())
            )
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": result.text})
            if args.verbose:
                t = result.timings
                print(
                    f"[kvfuse] turn {sum(m['role'] == 'user' for m in messages)}: prompt {result.prompt_tokens} tokens "
                    f"({result.cached_tokens} cached"
                    f"{' from ' + ','.join(sorted(set(result.hit_tiers))) if result.hit_tiers else ''}"
                    f"{f', {dropped} oldest messages dropped' if dropped else ''}), {result.completion_tokens} "
                    f"generated; time to first token {t.ttft_s * 1000:.0f} ms",
                    file=sys.stderr,
                )
    finally:
        engine.close()
    return 0


def read_documents(path: Path) -> list[str]:
    """The documents of a .txt file (one), a .jsonl file (one ``{"text": ...}`` or JSON string per
    line) or a folder of them (sorted by name); UserError naming the file and the fix."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise UserError(f"{path}: no .txt or .jsonl files in this folder")
        return [doc for f in files for doc in read_documents(f)]
    if not path.is_file():
        raise UserError(f"{path}: no such file or folder")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f'{path}:{n}: not JSON ({e.msg}); write one {{"text": ...}} object per line'
            ) from None
        doc = item.get("text") if isinstance(item, dict) else item
        if not isinstance(doc, str):
            raise UserError(f'{path}:{n}: expected a string or an object with a "text" string')
        docs.append(doc)
    return docs


def cmd_precompute(args, config: Config) -> int:
    from .engine import CacheOptions
    from .runtime import open_engine

    documents = [doc for path in args.paths for doc in read_documents(Path(path))]
    if not config.cache.enabled:
        raise UserError("the cache is disabled in this configuration (cache.enabled: false)")
    engine = open_engine(config)
    try:
        from tqdm import tqdm

        with tqdm(total=len(documents), unit="doc", file=sys.stderr, disable=None) as bar:

            def progress(tokens: int, computed: bool) -> None:
                bar.update(1)

            counts = engine.precompute_documents(
                documents,
                CacheOptions(tenant=args.tenant, salt=args.cache_salt),
                on_document=progress,
            )
    finally:
        engine.close()  # flushes the writes to disk / Redis
    print(
        f"{counts['documents']} documents ({counts['tokens']} tokens): {counts['computed']} computed and stored, "
        f"{counts['cached']} already cached"
    )
    return 0


def _calibration_items(args) -> dict:
    """``kvfuse calibrate``'s items (sources, forms, holdout, confidence) as ``calibrate``'s
    keyword arguments, checked; says so when a source's data is missing."""
    from .calibration import forms, options, sources
    from .calibration.choose import Targets

    try:
        names, note = options.parse_sources(args.sources, sources.available())
        space = forms.parse_forms(args.forms, options.parse_documents(args.documents))
    except ValueError as e:
        raise UserError(f"{e}") from None
    if note:
        print(f"kvfuse calibrate: {note}", file=sys.stderr)
    if not 0 <= args.holdout < 1:
        raise UserError(f"--holdout: expected a fraction in [0, 1), got {args.holdout:g}")
    if not 0.5 < args.confidence < 1:
        raise UserError(f"--confidence: expected a value in (0.5, 1), got {args.confidence:g}")
    return {
        "items": args.items,
        "source_names": names,
        "space": space,
        "fraction": args.holdout,
        "targets": Targets(confidence=args.confidence),
    }


def _blend_grid(args) -> tuple[list[str], list[float], list[str] | None, dict]:
    """The methods, budgets, document contexts and items of ``kvfuse calibrate``, checked."""
    from .config import CONTEXTS, METHODS

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS or m == "prefix"]
    if bad or not methods:
        raise UserError(
            f"--methods: unknown blend method {bad[0] if bad else '(none)'}; use a list of: "
            f"{', '.join(m for m in METHODS if m != 'prefix')}"
        )
    ratios = [_ratio_number(r) for r in args.ratios.split(",") if r.strip()]
    if not ratios:
        raise UserError("--ratios: give at least one budget, e.g. --ratios 0.15,0.3")
    contexts = [c.strip() for c in (args.contexts or "").split(",") if c.strip()] or None
    bad = [c for c in contexts or () if c not in CONTEXTS]
    if bad:
        raise UserError(
            f"--contexts: unknown document context {bad[0]!r}; use a list of: {', '.join(CONTEXTS)}"
        )
    return methods, ratios, contexts, _calibration_items(args)


def _current_profile(path: Path, config: Config, model, needed: bool):
    """The model's profile whose part not measured now is kept: the one at ``path`` (the output),
    else the user's, else the shipped one; None if there is none. An unusable file at ``path`` is
    an error when ``needed``, else ignored (it is about to be replaced)."""
    from .config import profiles as profile

    if not path.is_file():
        return profile.find(model.fingerprint, config.home_path / "profiles")
    try:
        found = profile.load(path)
        problem = (
            None
            if found.fingerprint == model.fingerprint
            else f"{path} is the profile of another model ({found.model}, fingerprint {found.fingerprint})"
        )
    except profile.ProfileError as e:
        found, problem = None, str(e)
    if problem is None:
        return found
    if needed:
        raise UserError(f"{problem}: give another --output, or measure both parts with --part all")
    log.warning("%s: replaced", problem)
    return None


def _calibrate_blend(args, config: Config, model, grid):
    """The blend part of ``kvfuse calibrate``: a profile (its ``codec`` not set), the table printed."""
    from .calibration import calibrate
    from .calibration.options import ProgressLog, table
    from .runtime import open_engine
    from .store import TieredStore
    from .tiers import MemoryTier

    methods, ratios, contexts, items = grid
    # In memory only: calibration must not fill the configured disk or Redis tiers.
    engine = open_engine(config, model, TieredStore(MemoryTier(2 << 30), []))
    command = (
        f"kvfuse calibrate {config.model} --items {args.items} --methods {','.join(methods)} "
        f"--ratios {','.join(f'{r:g}' for r in ratios)}"
        + (f" --contexts {','.join(contexts)}" if contexts else "")
        + f" --sources {','.join(items['source_names'])} --documents {args.documents}"
        + (f" --forms {args.forms}" if args.forms else "")
        + f" --holdout {args.holdout:g} --confidence {args.confidence:g}"
    )
    command += " --part blend" if args.part == "blend" else f" --codec-items {args.codec_items}"
    command += " --measure-all" if args.measure_all else ""
    try:
        from tqdm import tqdm

        with tqdm(total=args.items, unit="item", file=sys.stderr, disable=None) as bar:
            log = ProgressLog(sys.stderr)  # lines where the bar is off: not a terminal
            result, report = calibrate.calibrate(
                engine,
                command,
                methods=methods,
                ratios=ratios,
                contexts=contexts,
                progress=lambda part, state: log(part, state) if bar.disable else bar.update(1),
                eliminate=not args.measure_all,
                **items,
            )
    except ValueError as e:  # forms a model cannot take, too few items for a holdout
        raise UserError(str(e)) from None
    finally:
        engine.close()
    print("\n".join(table(result.measured, result.meta)))
    return result


def _calibrate_codec(args, config: Config, model) -> dict:
    """The codec part of ``kvfuse calibrate``: the profile's ``codec`` field, the levels printed."""
    from tqdm import tqdm

    from .calibration import codec_level

    command = f"kvfuse calibrate {config.model} --part codec --codec-items {args.codec_items}"
    with tqdm(total=args.codec_items, unit="item", file=sys.stderr, disable=None) as bar:
        codec = codec_level.calibrate_level(
            model,
            command,
            items=args.codec_items,
            chunk_size=config.cache.chunk_size,
            progress=lambda done, total: bar.update(1),
        )
    print("  cachegen level  K cap  NLL      vs lossless  KL       vs int8  bytes/token")
    for row in codec["measured"]:
        cap = "-" if row.get("k_cap") is None else f"{row['k_cap']:g}x"
        print(
            f"  {row['level']:>14}  {cap:>5}  {row['nll']:<7.4f}  {row['nll_increase']:>+10.2%}   "
            f"{row['kl']:<7.4f}  {row['ratio_vs_int8']:>6.2f}x  {row['bytes_per_token']:>11.1f}"
        )
    return codec


def cmd_calibrate(args, config: Config) -> int:
    from .config import profiles as profile
    from .runtime import open_model

    grid = _blend_grid(args)  # checked before a model is loaded, whatever the part
    # Each setting is measured as given (not through the model's current profile).
    config = dataclasses.replace(
        config, blend=dataclasses.replace(config.blend, recompute_ratio=0.15)
    )
    model = open_model(config)
    path = (
        Path(args.output)
        if args.output
        else profile.path_for(config.home_path / "profiles", model.fingerprint)
    )
    current = (
        _current_profile(path, config, model, args.part == "codec") if args.part != "all" else None
    )
    if args.part == "codec" and current is None:
        raise UserError(
            f"no profile of {config.model} to add the CacheGen level to (none at {path}, among the "
            f"user's or the shipped ones): run `kvfuse calibrate {config.model}` to measure the blend "
            "and the level together"
        )
    result = current if args.part == "codec" else _calibrate_blend(args, config, model, grid)
    if args.part != "blend":
        result = dataclasses.replace(result, codec=_calibrate_codec(args, config, model))
    elif current is not None:  # the level measured before stays with the new blend
        result = dataclasses.replace(result, codec=current.codec)
    profile.write(result, path)  # the output, or where the model's profile is looked up
    b = result.blend
    what = (
        "no blending (documents reused as an exact prefix)"
        if b["method"] == "prefix"
        else f"{b['method']} at {b['recompute_ratio']:g}"
    )
    level = (
        f"CacheGen level {result.codec['cachegen_level']}: {result.codec['reason']}"
        if result.codec
        else "CacheGen level: not calibrated (the default)"
    )
    print(f"{config.model}: {what}: {result.reason}\n{config.model}: {level}\nprofile: {path}")
    return 0


def cmd_serve(args, config: Config) -> int:
    from .server.app import serve

    serve(config, on_ready=lambda url, engine: _ready_lines(config, url, engine))
    return 0


def _ready_lines(config: Config, url: str, engine) -> None:
    """What ``kvfuse serve`` prints once it listens: where, the CPU path, the memory it holds."""
    from .resident import memory_line, resident_bytes, weights_bytes

    model = engine.model
    kv = engine.queue_state()
    memory = memory_line(
        resident_bytes(),
        weights_bytes(model.runner.weights),
        kv.get("kv_bytes_used", 0),
        kv.get("kv_bytes_limit", 0),
    )
    print(
        f"kvfuse: serving {config.model} at {url}/v1 (CPU backend: {model.backend.describe()})\n"
        f"kvfuse: {memory}",
        file=sys.stderr,
        flush=True,
    )


def cmd_cache(args, config: Config) -> int:
    from .runtime import open_store

    store = open_store(config)
    if store is None:
        raise UserError("the cache is disabled in this configuration (cache.enabled: false)")
    try:
        if args.action == "stats":
            rows = {t.name: {"entries": t.entries(), "bytes": t.used_bytes()} for t in store.lower}
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for name, r in rows.items():
                    entries = "?" if r["entries"] is None else r["entries"]
                    size = "?" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f} MiB"
                    print(f"{name:<8} {entries:>8} entries  {size:>12}")
            return 0
        if args.action == "clear":
            names = [t.name for t in store.lower]
            if args.tier != "all" and args.tier not in names:
                raise UserError(
                    f"--tier {args.tier}: no such tier in this configuration; tiers: all, {', '.join(names)}"
                )
            removed = 0
            for tier in store.lower:
                if args.tier in ("all", tier.name):
                    removed += tier.delete_prefix(args.prefix) if args.prefix else tier.clear()
            disk = next((t for t in config.lower_tiers() if t.kind == "disk"), None)
            if disk is not None and args.tier in (
                "all",
                disk.tier_name,
            ):  # the ids of the histories they held
                from .history import HistoryIndex

                HistoryIndex(
                    config.cache.history_records, config.disk_path / "histories"
                ).delete_prefix(args.prefix)
            print(f"removed {removed} entries")
            return 0
        if args.target is None:
            return _inspect_all(store, args.limit, args.json)
        return _inspect(args.target, store)
    finally:
        store.close()


def _inspect(target: str, store) -> int:
    from .kv.format import FormatError, read_header
    from .kv.keys import ChunkKey

    path = Path(target)
    if path.is_file():
        blob, where = path.read_bytes(), str(path)
    else:
        try:
            key = ChunkKey.parse(target)
        except ValueError:
            raise UserError(
                f"{target!r} is neither an entry file nor a storage key ('<48 hex>:<p|d|t|c>:<64 hex>', as "
                f"printed in file names with ':' written as '_3A')"
            ) from None
        blob, where = None, ""
        for tier in store.lower:
            blob = tier.get(key)
            if blob is not None:
                where = tier.name
                break
        if blob is None:
            raise UserError(
                f"{target!r} is neither an entry file nor a key held by the disk or Redis tier"
            )
    try:
        # with signing on, whether an accepted key signed it
        header = read_header(blob, store.signer)
    except FormatError as e:
        raise UserError(f"{where}: not a valid kvfuse entry: {e}") from e
    info = {"source": where, **{k: getattr(header, k) for k in header.__dataclass_fields__}}
    info["raw_bytes"] = header.raw_payload_size
    info["compression_ratio"] = round(header.compression_ratio, 3)
    print(json.dumps(info, indent=2, default=str))
    return 0


def _signature_note(signature: str, signing: bool) -> str:
    """What the listing says about an entry's signature: only what would make a read refuse it."""
    if signature == "invalid":
        return "  (signed by no accepted key: refused)"
    return "  (unsigned: refused)" if signing and signature == "unsigned" else ""


def _inspect_all(store, limit: int, as_json: bool) -> int:
    """Each entry of the disk and Redis tiers (up to ``limit`` per tier): codec, level, tokens,
    size and compression ratio against the raw KV; then totals per tier and encoding."""
    if limit < 1:
        raise UserError("--limit must be at least 1")
    rows, summary = _inspected_entries(store, limit)
    if as_json:
        print(json.dumps({"entries": rows, "summary": summary}, indent=2))
        return 0
    if not rows:
        print("no entries in the disk or Redis tier")
        return 0
    _print_inspection(rows, summary, store.signer is not None)
    return 0


def _inspected_entries(store, limit: int) -> tuple[list[dict], list[dict]]:
    """The rows of ``kvfuse cache inspect`` (one per entry read, an ``error`` for a header that
    does not parse) and the totals per tier and encoding, read from the entries' headers only."""
    from .kv.format import FormatError, read_header

    rows, totals = [], {}
    for tier in store.lower:
        for key in tier.keys(limit):  # most recently used first where the tier knows recency
            blob = tier.get(key)
            if blob is None:
                continue
            try:
                h = read_header(blob, store.signer)
            except FormatError as e:
                rows.append({"tier": tier.name, "key": str(key), "error": str(e)})
                continue
            encoding = h.codec if h.codec_id == 1 else f"{h.codec}.{h.level}"
            row = {
                "tier": tier.name,
                "key": str(key),
                "codec": h.codec,
                "level": h.level,
                "tokens": h.shape[2],
                "bytes": h.header_size + h.payload_size,
                "raw_bytes": h.raw_payload_size,
                "ratio": round(h.compression_ratio, 2),
                "intact": h.payload_ok,
                "signature": h.signature,
            }
            rows.append(row)
            t = totals.setdefault((tier.name, encoding), [0, 0, 0])
            t[0], t[1], t[2] = t[0] + 1, t[1] + row["bytes"], t[2] + row["raw_bytes"]
    summary = [
        {
            "tier": tier,
            "encoding": enc,
            "entries": n,
            "bytes": b,
            "raw_bytes": r,
            "ratio": round(r / b, 2) if b else None,
        }
        for (tier, enc), (n, b, r) in sorted(totals.items())
    ]
    return rows, summary


def _print_inspection(rows: list[dict], summary: list[dict], signing: bool) -> None:
    """The listing of ``kvfuse cache inspect`` as a table: the entries, then the totals."""
    print(f"{'tier':<6} {'codec':<9} {'level':>5} {'tokens':>6} {'bytes':>10} {'ratio':>6}  key")
    for r in rows:
        if "error" in r:
            print(
                f"{r['tier']:<6} {'?':<9} {'?':>5} {'?':>6} {'?':>10} {'?':>6}  {r['key']}  ({r['error']})"
            )
        else:
            notes = ("" if r["intact"] else "  (damaged payload)") + _signature_note(
                r["signature"], signing
            )
            print(
                f"{r['tier']:<6} {r['codec']:<9} {r['level']:>5} {r['tokens']:>6} {r['bytes']:>10} "
                f"{r['ratio']:>5.2f}x  {r['key']}{notes}"
            )
    print()
    for t in summary:
        print(
            f"{t['tier']:<6} {t['encoding']:<12} {t['entries']:>6} entries  {t['bytes'] / 2**20:9.1f} MiB  "
            f"{t['ratio']}x smaller than raw"
        )


def cmd_responses(args, config: Config) -> int:
    from .history.response_store import ResponseNotFound, ResponseStore

    if not config.responses_path.is_file():
        raise UserError(
            f"no stored responses at {config.responses_path} (responses.path); a server stores them there "
            "when responses.store is true"
        )
    responses = ResponseStore(config.responses_path, config.responses.ttl_s)
    try:
        if args.action == "list":
            _list_responses(responses.list(args.tenant, args.limit), args.json)
            return 0
        if args.action == "show":
            try:
                print(json.dumps(responses.get(args.tenant, args.id).body, indent=2))
            except ResponseNotFound:
                raise UserError(
                    f"no response {args.id!r} for tenant {args.tenant!r} (expired, deleted or another "
                    "tenant's: see kvfuse responses list)"
                ) from None
            return 0
        if args.action == "delete":
            try:
                keys = responses.delete(args.tenant, args.id)
            except ResponseNotFound:
                raise UserError(
                    f"no response {args.id!r} for tenant {args.tenant!r} (see kvfuse responses list)"
                ) from None
        else:
            n, keys = responses.purge()
            print(f"removed {n} expired responses")
        freed = _free(config, keys)
        print(f"freed {freed} entries")
        return 0
    finally:
        responses.close()


def _list_responses(rows, as_json: bool) -> None:
    """``kvfuse responses list``: each stored response's id, tenant, age and turns, as JSON or one
    line each (with the start of its last answer, to tell them apart)."""
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "id": r.id,
                        "tenant": r.tenant,
                        "created_at": r.created_at,
                        "expires_at": r.expires_at,
                        "previous_response_id": r.previous_id,
                        "turns": sum(m["role"] == "user" for m in r.history),
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return
    for r in rows:
        text = next((m["content"] for m in reversed(r.history) if m["role"] == "assistant"), "")
        print(
            f"{r.id}  tenant={r.tenant or '-'}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(r.created_at))}"
            f"  turns={sum(m['role'] == 'user' for m in r.history)}  {text[:60]!r}"
        )


def cmd_keys(args, config: Config) -> int:
    from .config.api_keys import is_digest, key_digest

    key = args.key
    if key is None:
        line = sys.stdin.readline()
        key = line[:-1] if line.endswith("\n") else line
    if not key:
        raise UserError(
            "no key given: pass it as an argument or on stdin (echo -n KEY | kvfuse keys digest)"
        )
    if is_digest(key):
        raise UserError("that is a digest already (sha256:...): give the key itself")
    if args.tenant is not None and not args.tenant:
        raise UserError("--tenant: give the tenant's name (the API key's owner)")
    digest = key_digest(key)
    print(f"{digest}:{args.tenant}" if args.tenant else digest)
    return 0


def _free(config: Config, keys: list[str]) -> int:
    """Remove the entries ``keys`` from the configured tiers; how many were removed."""
    from .kv.keys import ChunkKey
    from .runtime import open_store

    store = open_store(config) if keys else None
    if store is None:
        return 0
    try:
        return sum(store.delete([ChunkKey.parse(k) for k in keys]).values())
    finally:
        store.close()


COMMANDS = {
    "models": cmd_models,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "serve": cmd_serve,
    "precompute": cmd_precompute,
    "calibrate": cmd_calibrate,
    "cache": cmd_cache,
    "responses": cmd_responses,
    "keys": cmd_keys,
}


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .models import CorruptModel, ModelNotFound, ModelPackageMissing

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
        return COMMANDS[args.command](args, config)
    except (
        UserError,
        ConfigError,
        ModelNotFound,
        ModelPackageMissing,
        CorruptModel,
        ValueError,
        FileNotFoundError,
    ) as e:
        print(f"kvfuse: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
