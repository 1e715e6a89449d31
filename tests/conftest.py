"""Shared fixtures. Test modules import helpers from this folder (tiny_models, fixtures_redis)."""

from __future__ import annotations

import pytest
import torch
from fixtures_redis import redis_server  # noqa: F401  (a real redis-server per test)

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function giving the folder of a tiny random model of a family (built once per session)."""
    from tiny_models import build_tiny

    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session")
def kvfuse_home(tmp_path_factory):
    """The kvfuse home for tests: ``$KVFUSE_HOME`` when set (CI converts the models into it once),
    else a session temp folder."""
    import os
    from pathlib import Path

    home = os.environ.get("KVFUSE_HOME")
    return Path(home) if home else tmp_path_factory.mktemp("kvfuse-home")


@pytest.fixture(scope="session", autouse=True)
def _export_kvfuse_home(kvfuse_home):
    """Export that home as ``KVFUSE_HOME`` for the whole session, so that code resolving the default
    home (``load_model(name)`` without ``home=``, subprocesses) shares it and models convert once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFUSE_HOME", str(kvfuse_home))
        yield kvfuse_home


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir, tmp_path_factory):
    """A function giving the ``LoadedModel`` of a tiny random family with a word tokenizer (loaded once)."""
    from kvfuse_helpers import tiny_loaded_model, write_word_tokenizer

    tok = write_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"), 512)
    loaded: dict[str, object] = {}

    def get(name: str = "llama"):
        if name not in loaded:
            loaded[name] = tiny_loaded_model(tiny_model_dir(name), tok)
        return loaded[name]

    return get
