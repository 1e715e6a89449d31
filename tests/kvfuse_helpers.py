"""Shared test helpers: the model home, cached model loads, a tiny-model engine, and a worker script.

The model home is ``$KVFUSE_HOME`` when set (CI converts the built-in models there once), else one
temporary directory per test process. Loaded models are cached per process, so every test module
shares one SmolLM2 load.

Run as a script, this file is one engine process of the multi-process Redis test::

    python tests/kvfuse_helpers.py --home H --redis-url URL --prompt-file F --max-tokens N

prints one JSON line ``{"token_ids", "cached_tokens", "hit_tiers", "stored_chunks"}`` on stdout.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

_HOME: Path | None = None


def model_home() -> Path:
    """``$KVFUSE_HOME`` or a per-process temporary home (removed at exit)."""
    global _HOME
    if _HOME is None:
        if os.environ.get("KVFUSE_HOME"):
            _HOME = Path(os.environ["KVFUSE_HOME"])
        else:
            _HOME = Path(tempfile.mkdtemp(prefix="kvfuse-test-home-"))
            atexit.register(shutil.rmtree, _HOME, True)
    return _HOME


@functools.cache
def builtin_folder(name: str) -> Path:
    """The converted folder of built-in model ``name`` (converted into the home on first use)."""
    from kvfuse.models import registry

    return registry.pull(name, model_home())


@functools.cache
def load_builtin(name: str, weights: str = "auto"):
    """A built-in model on the CPU computing in fp32 (loaded once per process and ``weights``:
    ``auto`` runs the GGUF file's own blocks, ``fp32`` its float32 copy)."""
    from kvfuse.models import load_model

    builtin_folder(name)
    return load_model(name, home=model_home(), device="cpu", dtype="float32", weights=weights)


def write_word_tokenizer(folder: Path, vocab_size: int, eos_id: int = 2) -> Path:
    """A real ``tokenizers`` WordLevel tokenizer whose ids 0..vocab_size-1 decode to ``t<id>``.

    The tiny random models have no tokenizer; the engine only decodes with it (ids in, text out).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = HFTokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos_id}"}))
    return folder


def tiny_loaded_model(model_folder: Path, tokenizer_folder: Path):
    """A ``LoadedModel`` over a tiny random HF folder (fp32 compute on the CPU)."""
    from kvfuse.models import LoadedModel, Tokenizer
    from kvfuse.models.loader import fingerprint, load_folder, sha256_file, weight_files

    runner = load_folder(model_folder)
    digests = [sha256_file(f) for f in weight_files(model_folder)]
    return LoadedModel(
        model_folder.name,
        model_folder,
        runner,
        Tokenizer(tokenizer_folder),
        fingerprint(runner.config, digests),
    )


SENTENCES = [
    "The harbour town of Velmora sits where the river Aske meets the northern sea.",
    "Its lighthouse was built in 1847 by a stonemason named Ilse Garrow, who also carved the fountain in the square.",
    "Every spring the fishing fleet is blessed, and the bakers sell a bread flavoured with fennel and salt.",
    "The town library keeps a collection of ship logs that go back more than two hundred years.",
    "Visitors often take the ferry to the island of Brell, where puffins nest on the western cliffs.",
    "In winter the harbour sometimes freezes, and children skate between the moored boats.",
    "The council meets on the first Tuesday of each month in a hall that used to be a rope factory.",
    "A narrow railway once carried coal from the hills, but today its track is a path for walkers.",
]


def uncached_engine(home: Path, model: str):
    """An in-process engine on ``model`` from ``home`` with the cache off: the full-prefill
    reference that server answers are compared against."""
    from kvfuse.config import load_config
    from kvfuse.runtime import open_engine

    return open_engine(
        load_config(overrides={"home": str(home), "model": model, "cache.enabled": False})
    )


def greedy_reference(model, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``ids`` computed whole, with nothing cached (one prefill, then one token per
    pass: the engine's single-request path), and the top-2 logit gap at each step."""
    import torch

    runner = model.runner
    with torch.inference_mode():
        cache = runner.new_cache(len(ids) + max_tokens, dtype=torch.float16)
        logits = runner.forward(ids, cache)
        tokens, gaps = [], []
        for _ in range(max_tokens):
            top = torch.topk(logits.float(), 2).values
            gaps.append(float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
            logits = runner.forward([tokens[-1]], cache)
    return tokens, gaps


def long_text(paragraphs: int = 6) -> str:
    """About 100 tokens per paragraph; each paragraph is numbered so no chunk repeats."""
    return "\n\n".join(
        f"Part {i + 1}. " + " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(5))
        for i in range(paragraphs)
    )


def _worker(argv: list[str] | None = None) -> None:
    import argparse

    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.models import load_model
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier, RedisTier

    p = argparse.ArgumentParser()
    p.add_argument("--home", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args(argv)
    model = load_model("smollm2", home=Path(args.home), device="cpu", dtype="float32")
    store = TieredStore(MemoryTier(1 << 30), [RedisTier(args.redis_url, timeout_s=2.0)])
    engine = Engine(model, store)
    ids = [int(t) for t in Path(args.prompt_file).read_text().split()]
    result = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    engine.close()  # saves what is queued and flushes the Redis writes
    print(
        json.dumps(
            {
                "token_ids": result.token_ids,
                "cached_tokens": result.cached_tokens,
                "hit_tiers": list(result.hit_tiers),
                "stored_chunks": result.stored_chunks,
            }
        )
    )


if __name__ == "__main__":
    _worker()
