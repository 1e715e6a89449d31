"""A model's vocabulary as the grammar engine sees it, and the compiled grammars kept for it.

llguidance builds its token trie from the very ``tokenizer.json`` kvfuse tokenizes with (the
``tokenizers`` library's own serialization, added tokens included), so the bytes a mask allows
are the bytes kvfuse decodes: no second tokenizer, no transformers. Building it takes from half
a second (SmolLM2, 49k tokens) to seconds (Gemma 3, 262k), so there is one ``Vocabulary`` per
tokenizer and end-of-sequence set, built on first use (``vocabulary``) and kept as long as the
tokenizer lives. Each holds a bounded LRU of compiled grammars (``GrammarCache``) keyed by the
grammar's source text.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfuse.models.tokenizer import Tokenizer

DEFAULT_CACHE_SIZE = 128


class GrammarCache:
    """A bounded, thread-safe LRU: key -> compiled grammar. Two threads that miss on the same key
    at once both compile it (the grammar is the same; the later one is kept): compiling never
    runs under the lock, so one slow schema does not hold up the others."""

    def __init__(self, size: int = DEFAULT_CACHE_SIZE):
        if size < 0:
            raise ValueError(f"the grammar cache size must be >= 0, got {size}")
        self.size = size
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key, build: Callable[[], Any]):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
        value = build()
        with self._lock:
            if self.size:
                self._items[key] = value
                self._items.move_to_end(key)
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)


class Vocabulary:
    """One tokenizer's vocabulary for llguidance (``ll``), its size, the ids that end a sequence
    (allowed only once the output is complete) and its compiled grammars (``cache``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: Iterable[int] = (),
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        import llguidance

        eos = list(dict.fromkeys(int(i) for i in eos_token_ids))
        if not eos and tokenizer.eos_token_id is not None:
            eos = [tokenizer.eos_token_id]
        if not eos:
            raise ValueError(
                "structured outputs need an end-of-sequence token; this tokenizer has none"
            )
        self.size = tokenizer.vocab_size
        self.eos_token_ids = tuple(eos)
        self.ll = llguidance.LLTokenizer(
            tokenizer.hf_tokenizer.to_str(), n_vocab=self.size, eos_token=eos
        )
        self.cache = GrammarCache(cache_size)


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def vocabulary(source, eos_token_ids: Iterable[int] | None = None) -> Vocabulary:
    """The ``Vocabulary`` of ``source``: a ``Vocabulary`` (as it is), a ``LoadedModel`` (its
    tokenizer and the model's end-of-sequence ids) or a ``Tokenizer`` (its own end-of-sequence
    token unless ``eos_token_ids`` are given). Built once per tokenizer and end-of-sequence set."""
    if isinstance(source, Vocabulary):
        return source
    tokenizer = getattr(source, "tokenizer", source)
    if eos_token_ids is None:
        eos_token_ids = getattr(source, "eos_token_ids", None) or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        )
    key = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
    with _LOCK:  # held while building: a second caller waits for the first's vocabulary
        per_tokenizer = _VOCABULARIES.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            per_tokenizer[key] = Vocabulary(tokenizer, key)
        return per_tokenizer[key]
