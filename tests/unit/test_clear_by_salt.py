"""Clearing a cache salt is an erasure control (issue 39 item 11): every entry stored under the salt
goes, whatever namespace derived from it holds it (plain prompts, blended prompts, a conversation
continued after dropped turns), and another salt's entries stay, on a tiny random model (CPU)."""

from __future__ import annotations

import torch

from kvfuse.blend.options import BlendOptions
from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine
from kvfuse.generation import SamplingParams
from kvfuse.kv.keys import salt_prefix
from kvfuse.prompts.prompt import Prompt
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

CH = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM, DROPPED, KEPT = ids_of(10, 1), ids_of(40, 2), ids_of(40, 3)
PREFIX, DOCS, SUFFIX = ids_of(20, 4), [ids_of(37, 5), ids_of(29, 6)], ids_of(9, 7)


def store_everything(engine: Engine, salt: str) -> None:
    """Entries under ``salt`` in each kind of namespace: a plain prompt, a blended one (documents),
    and a conversation continued after its oldest turn was dropped (its KV kept, moved: a
    namespace derived from the history)."""
    cache = CacheOptions(salt=salt)
    engine.generate(SYSTEM + DROPPED + KEPT, GREEDY, cache=cache)
    engine.generate(SYSTEM + KEPT + ids_of(6, 8), GREEDY, cache=cache)
    engine.generate(Prompt.of(PREFIX, DOCS, SUFFIX), GREEDY, cache=cache)
    engine.flush()


def namespaces(tiers, salt: str) -> set[str]:
    prefix = salt_prefix("", salt)
    return {k.namespace_id for t in tiers for k in t.keys() if str(k).startswith(prefix)}


def test_clearing_a_salt_removes_every_namespace_derived_from_it(tiny_loaded, tmp_path):
    model = tiny_loaded("qwen3")
    memory, disk = MemoryTier(64 << 20), DiskTier(tmp_path / "kv", 64 << 20)
    blend = BlendOptions(recompute_ratio=0.2, store_blended=True)
    settings = EngineSettings.of(chunk_size=CH, truncation="reuse", blend=blend)
    engine = Engine(model, TieredStore(memory, [disk]), settings)
    for salt in ("x", "y"):
        store_everything(engine, salt)
    plain, blended = engine.namespace("", "x"), engine.namespace("", "x", engine.cache.blend)
    held = namespaces([memory, disk], "x")
    # the plain and the blended namespaces, and at least one derived from the history
    assert {plain.short_id(), blended.short_id()} < held and len(held) >= 3
    kept_y = {
        k for t in (memory, disk) for k in t.keys() if str(k).startswith(salt_prefix("", "y"))
    }

    done = engine.clear_cache("", "x", timeout=5.0)
    assert done.complete and done.removed["memory"] > 0 and done.removed["disk"] > 0
    assert namespaces([memory, disk], "x") == set()
    assert all(memory.contains(k) or disk.contains(k) for k in kept_y)  # the other salt's stay
    # and every kind is a miss for the salt cleared, a hit for the other
    for salt, hit in (("x", False), ("y", True)):
        cache = CacheOptions(salt=salt)
        blended_again = engine.generate(Prompt.of(PREFIX, DOCS, ids_of(9, 9)), GREEDY, cache=cache)
        turn = engine.generate(SYSTEM + KEPT + ids_of(6, 8) + [5, 6], GREEDY, cache=cache)
        assert (blended_again.cached_tokens > 0) is hit, salt
        assert (turn.cached_tokens > len(SYSTEM)) is hit, salt
    engine.close()


def test_a_tenant_clear_and_a_salt_clear_leave_other_tenants_alone(tiny_loaded):
    model = tiny_loaded("llama")
    memory = MemoryTier(64 << 20)
    engine = Engine(model, TieredStore(memory), EngineSettings.of(chunk_size=CH))
    for tenant in ("alice", "bob"):
        engine.generate(SYSTEM + KEPT, GREEDY, cache=CacheOptions(tenant=tenant, salt="x"))
    engine.flush()
    bob = [k for k in memory.keys() if str(k).startswith(salt_prefix("bob", "x"))]
    assert bob and engine.clear_cache("alice", "x").removed["memory"] > 0
    assert engine.clear_cache("alice").removed["memory"] == 0  # nothing of alice's is left
    assert all(memory.contains(k) for k in bob)
    engine.close()
