"""The live KV of running sequences, within one budget (``engine.kv_memory_bytes``).

``KVMemory`` gives an admitted sequence its cache (its prompt, the tokens it generated before a
preemption, and room to decode a while), a forked choice its copy of the prompt's KV, grows a
cache as the sequence computes, and frees it when the sequence is preempted. Side effects,
stated: ``allocate``, ``fork`` and ``grow`` take bytes from the budget (or say no); ``release`` first waits until the saver has copied out the chunks the sequence's
plan stores (their bytes live in that cache), then gives the cache's bytes back. A cache's bytes
also go back by themselves when its buffer is freed (``models.cache``): a finished sequence's,
once the saver is done with it.
"""

from __future__ import annotations

import gc

import torch

from kvfuse.models.cache import KVBudget, OutOfKVMemory, slot_bytes
from kvfuse.models.transformer import Transformer

from .sequence import Sequence

# Slots a sequence is admitted with beyond its prompt (its cache grows as it decodes): enough for
# short answers without a reallocation, without reserving max_tokens up front.
DECODE_HEADROOM = 64


class KVMemory:
    """Caches of running sequences in one ``KVBudget``; see the module docstring."""

    def __init__(
        self, runner: Transformer, kv_dtype: torch.dtype, limit_bytes: int | None, cache=None
    ):
        # ``cache``: the cache engine (``release``, ``settle``); None in tests of memory alone
        self.runner, self.kv_dtype, self.cache = runner, kv_dtype, cache
        self.budget = KVBudget(limit_bytes)
        self.slot_bytes = slot_bytes(runner.config, kv_dtype)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError when a request could never fit: its prompt and answer need more live KV than
        the whole budget."""
        limit = self.budget.limit
        need = (prompt_tokens + max_tokens) * self.slot_bytes
        if limit is not None and need > limit:
            raise ValueError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {need / 2**20:.1f} MiB of live "
                f"KV, more than the engine's whole KV memory budget ({limit / 2**20:.1f} MiB, "
                f"engine.kv_memory_bytes): shorten the prompt, lower max_tokens or raise the budget"
            )

    def never_fits(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never be given its cache, even with the whole budget free (None: it
        can, once enough is released). ``check`` refused such requests at submit, but what runs
        can be longer than what was checked (a prompt lined up with a stored history, a
        preempted sequence's generated tokens)."""
        limit = self.budget.limit
        slots = initial_slots(seq.prompt_len, len(seq.token_ids), seq.request.params.max_tokens)
        if limit is None or slots * self.slot_bytes <= limit:
            return None
        return (
            f"the request needs {slots} slots of live KV ({slots * self.slot_bytes / 2**20:.1f} "
            f"MiB), more than the engine's whole KV memory budget ({limit / 2**20:.1f} MiB, "
            f"engine.kv_memory_bytes)"
        )

    def allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` its cache from the budget (if it has none yet); False if it does not fit."""
        if seq.kv is None:
            n, p = len(seq.token_ids), seq.request.params
            try:
                slots = initial_slots(seq.prompt_len, n, p.max_tokens)
                seq.kv = self.runner.new_cache(slots, dtype=self.kv_dtype, budget=self.budget)
            except OutOfKVMemory:
                return False
        return True

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give forked choice ``child`` a copy of ``parent``'s prompt KV (``KVCache.fork``) with
        room to decode, from the budget; False (no copy) if it does not fit."""
        p = child.request.params
        try:
            child.kv = parent.kv.fork(initial_slots(child.prompt_len, 0, p.max_tokens))
        except OutOfKVMemory:
            return False
        return True

    def grow(self, seq: Sequence, total: int) -> bool:
        """Make room for ``total`` slots in ``seq``'s cache; False if the budget cannot hold them."""
        try:
            seq.kv.reserve(total)
            return True
        except OutOfKVMemory:
            return False

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s cache now, after the saver copied out the chunks its plan stores."""
        if self.cache is not None:
            self.cache.release(seq.reuse)  # its prompt's chunks, copied out first
        seq.kv.release()  # its bytes are back in the budget now

    def wait_for_release(self) -> None:
        """Nothing runs, yet the oldest waiting sequence did not fit: the KV it needs is still held
        by finished sequences whose chunks the saver is copying out (or by a reference cycle).
        Wait for the saver rather than spin on empty steps."""
        if self.cache is not None:
            self.cache.settle(timeout=0.5)
        gc.collect()

    def state(self) -> dict[str, int]:
        b = self.budget
        return {"kv_bytes_used": b.used, "kv_bytes_peak": b.peak, "kv_bytes_limit": b.limit or 0}


def initial_slots(prompt_len: int, generated: int, max_tokens: int) -> int:
    """The slots a sequence is admitted with: its prompt, the tokens it already generated (if it
    was preempted), and room to decode."""
    left = max_tokens - generated
    return prompt_len + generated + max(1, min(left, DECODE_HEADROOM))
