"""Three grammar engines behind one face, for ``bench/structured.py``: llguidance, XGrammar and
outlines-core, each fed the same kvfuse tokenizer (``kvfuse.models.tokenizer.Tokenizer``) through
its own vocabulary adapter, each compiling a JSON schema (``None``: any JSON object) into
something a per-sequence matcher starts from.

The matchers share one contract: ``fill(row)`` writes the next token's allowed set as a bitmask
(int32 words, bit ``i % 32`` of word ``i // 32``: token ``i``) into a row of an int32 tensor,
``accept(token)`` advances (False: the engine refused it). An output is complete when the next
mask allows nothing but end-of-sequence (``only_eos``), the one test that means the same for all
three. The same JSON formatting is asked of all three (separators ``", "`` and ``": "``, no
free whitespace), so that they constrain the same language and a valid instance serialized with
``json.dumps`` is a sentence of every one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

ITEM, KEY = ", ", ": "


@dataclass
class Vocab:
    """What every adapter is built from: the tokenizer's JSON, each id's bytes, the EOS ids."""

    tokenizer_json: str
    token_bytes: list[bytes]
    special: frozenset[int]
    eos: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @classmethod
    def of(cls, tokenizer, eos: tuple[int, ...]) -> Vocab:
        hf = tokenizer.hf_tokenizer
        special = frozenset(hf.get_added_tokens_decoder())
        return cls(hf.to_str(), tokenizer.token_bytes(), special, tuple(eos))


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def count(row: torch.Tensor) -> int:
    """How many tokens a bitmask row allows."""
    return int(unpack(row).sum())


def unpack(row: torch.Tensor) -> torch.Tensor:
    """A bitmask row as one bool per token (little-endian words: byte k of word w holds tokens
    32w + 8k .. 32w + 8k + 7)."""
    return _BITS[row.contiguous().view(torch.uint8).long()].reshape(-1)


_BITS = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1 == 1


def only_eos(row: torch.Tensor, eos: tuple[int, ...], size: int) -> bool:
    """The mask allows end-of-sequence and nothing else: the output is complete."""
    bits = unpack(row)[:size]
    return bool(bits[list(eos)].any()) and int(bits.sum()) == int(bits[list(eos)].sum())


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab):
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(
            vocab.tokenizer_json, n_vocab=vocab.size, eos_token=list(vocab.eos)
        )

    def compile(self, schema: dict | None) -> Any:
        options = {"whitespace_flexible": False, "item_separator": ITEM, "key_separator": KEY}
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=options
        )
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled) -> _LLMatcher:
        return _LLMatcher(compiled.deep_copy())


class _LLMatcher:
    def __init__(self, m):
        self.m = m

    def fill(self, row: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(
            vocab.token_bytes,
            xgrammar.VocabType.RAW,
            vocab_size=vocab.size,
            stop_token_ids=list(vocab.eos),
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, schema: dict | None) -> Any:
        return self.compiler.compile_json_schema(
            schema if schema is not None else {"type": "object"},
            any_whitespace=False,
            separators=(ITEM, KEY),
            strict_mode=schema is not None,  # json_object: any properties
        )

    def matcher(self, compiled) -> _XGMatcher:
        return _XGMatcher(self.xgr.GrammarMatcher(compiled))


class _XGMatcher:
    def __init__(self, m):
        self.m = m

    def fill(self, row: torch.Tensor) -> None:
        self.m.fill_next_token_bitmask(row[None])

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: Vocab):
        import outlines_core

        self.oc = outlines_core
        first = vocab.eos[0]
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if i not in vocab.special and i not in vocab.eos and b:
                tokens.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(first, tokens)

    def compile(self, schema: dict | None) -> Any:
        # No recursion in a regular language: "any object" is unrolled to nesting depth 3.
        regex = self.oc.json_schema.build_regex_from_schema(
            json.dumps(schema if schema is not None else {"type": "object"}), r"[ ]?"
        )
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled) -> _OCMatcher:
        return _OCMatcher(self.oc.Guide(compiled))


class _OCMatcher:
    def __init__(self, g):
        self.g = g

    def fill(self, row: torch.Tensor) -> None:
        self.g.write_mask_into(row.data_ptr(), row.numel(), 4)

    def accept(self, token: int) -> bool:
        try:
            self.g.advance(token, False)
            return True
        except ValueError:
            return False


ENGINES = {e.name: e for e in (LLGuidance, XGrammar, OutlinesCore)}
