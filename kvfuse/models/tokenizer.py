"""Tokenizer and chat template of a model folder (``tokenizer.json`` + ``tokenizer_config.json``).

Uses the ``tokenizers`` library directly and renders chat templates with a sandboxed Jinja
environment configured as transformers does (trim_blocks, lstrip_blocks, ``raise_exception``),
so the runtime does not import transformers.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The messages do not fit the model's chat template (or the model has none)."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        self._path = str(path)
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template_path = folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template_path.read_text() if template_path.is_file() else cfg.get("chat_template")
        )
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None
        self._decoder_kind = _decoder_kind(json.loads(path.read_text()).get("decoder"))
        self._bytes: list[bytes] | None = None
        self._plain: HFTokenizer | None = None  # special tokens encoded as text (encode_plain)
        self._special: frozenset[int] | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``: what a grammar engine builds its vocabulary
        from (``kvfuse.structured``). Not to be changed."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """The ids of ``text`` with no special token: text that spells one (``<|im_end|>``) is
        tokenized as the characters it is (HF's ``split_special_tokens``). For what a client
        wrote into a message or a document (``prompts.control``)."""
        if self._plain is None:  # built when first needed: a second copy of the vocabulary
            plain = HFTokenizer.from_file(self._path)
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special (control) tokens: added tokens flagged special."""
        if self._special is None:
            self._special = frozenset(
                i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
            )
        return self._special

    def encode_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each token's ``(start, end)`` character span in it."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (the raw piece, e.g. ``Ġthe``), as HF's
        ``convert_ids_to_tokens`` gives it; None outside the vocabulary."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self) -> list[bytes] | None:
        """The exact bytes each token id stands for (special tokens: their text), so that two
        tokenizations of one text can be told equal without decoding; None for a tokenizer whose
        decoder is not a byte-exact one this reads (byte-level BPE, or SentencePiece with byte
        fallback). Built once, on first use."""
        if self._decoder_kind is None:
            return None
        if self._bytes is None:
            added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
            table = []
            for i in range(self.vocab_size):
                piece = self._tok.id_to_token(i)
                if piece is None:
                    table.append(b"")
                elif piece in added:
                    table.append(piece.encode("utf-8"))
                else:
                    table.append(_piece_bytes(piece, self._decoder_kind))
            self._bytes = table
        return self._bytes

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **extra,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": str}, ...]``); ``tools``
        (function definitions) go to the template's ``tools`` argument, for templates that
        support tools (``kvfuse.tools``); None passes none."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template; send a plain completion prompt instead"
            )
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        if tools is not None:
            extra["tools"] = tools
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        # The template writes any BOS itself, so no special tokens are added on top.
        return self.encode(
            self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False
        )


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_map()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_kind(decoder: dict | None) -> str | None:
    """ "byte-level", "sentencepiece" (▁ for spaces, <0xNN> byte fallback) or None (unknown)."""
    if not isinstance(decoder, dict):
        return None
    if decoder.get("type") == "ByteLevel":
        return "byte-level"
    if decoder.get("type") == "Sequence":
        parts = decoder.get("decoders") or []
        types = [d.get("type") for d in parts]
        replaces = [d for d in parts if d.get("type") == "Replace"]
        if (
            "ByteFallback" in types
            and set(types) <= {"Replace", "ByteFallback", "Fuse"}
            and len(replaces) == 1
            and replaces[0].get("pattern", {}).get("String") == "\u2581"
            and replaces[0].get("content") == " "
        ):
            return "sentencepiece"
    return None


def _piece_bytes(piece: str, kind: str) -> bytes:
    if kind == "byte-level":
        return (
            bytes(_BYTE_LEVEL[c] for c in piece)
            if all(c in _BYTE_LEVEL for c in piece)
            else piece.encode("utf-8")
        )
    m = _BYTE_FALLBACK.match(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


class IncrementalDecoder:
    """Turns generated token ids into text pieces as they arrive.

    Byte-level BPE emits a multi-byte character over several tokens; text is released only once
    it no longer ends in a replacement character, and only the new part of it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # tokens before this are never decoded again
        self._read_offset = 0  # text of tokens before this has been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete character at the very end, as the tokenizer renders it)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]
