"""KV codecs and their registry: ``get_codec(name, level)`` and, for entry headers, ``get_codec_by_id``.

Codecs: ``raw`` (lossless), ``int8``, ``cachegen`` (levels 1-4, CacheGen),
``cachegen-rot`` (the same over Hadamard-rotated heads); more plug in with ``register_codec``; a codec's name and id are written into
keys and entry headers, so neither may ever be reused for a different encoding.
"""

from __future__ import annotations

from typing import Callable

from kvfuse.codecs.base import Codec, CodecError
from kvfuse.codecs.cachegen import CacheGenCodec
from kvfuse.codecs.cachegen_rot import CacheGenRotCodec
from kvfuse.codecs.int8 import Int8Codec
from kvfuse.codecs.raw import RawCodec

CodecFactory = Callable[[int], Codec]

_BY_NAME: dict[str, tuple[int, CodecFactory]] = {}
_BY_ID: dict[int, str] = {}


def register_codec(name: str, codec_id: int, factory: CodecFactory) -> None:
    """Make ``factory(level)`` available as ``name`` / ``codec_id``. Re-registering the same pair
    replaces the factory; a name or id already used for something else is a ValueError."""
    if not isinstance(codec_id, int) or not 0 < codec_id < 2**16:
        raise ValueError(f"codec_id must be an int in [1, 65535], got {codec_id!r}")
    if name in _BY_NAME and _BY_NAME[name][0] != codec_id:
        raise ValueError(f"codec name {name!r} is already registered with id {_BY_NAME[name][0]}")
    if codec_id in _BY_ID and _BY_ID[codec_id] != name:
        raise ValueError(f"codec id {codec_id} is already registered as {_BY_ID[codec_id]!r}")
    _BY_NAME[name] = (codec_id, factory)
    _BY_ID[codec_id] = name


def codec_names() -> list[str]:
    """Names of all registered codecs, sorted."""
    return sorted(_BY_NAME)


def get_codec(name: str, level: int = 0) -> Codec:
    """The codec ``name`` at ``level``; ValueError naming the known codecs on an unknown name."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(codec_names())}")
    return _BY_NAME[name][1](level)


def get_codec_by_id(codec_id: int, level: int = 0) -> Codec:
    """The codec written as ``codec_id`` in an entry header; ValueError if unknown."""
    if codec_id not in _BY_ID:
        raise ValueError(f"unknown codec id {codec_id}; known codecs: {', '.join(codec_names())}")
    return get_codec(_BY_ID[codec_id], level)


register_codec(RawCodec.name, RawCodec.codec_id, RawCodec)
register_codec(Int8Codec.name, Int8Codec.codec_id, Int8Codec)
register_codec(CacheGenCodec.name, CacheGenCodec.codec_id, CacheGenCodec)
register_codec(CacheGenRotCodec.name, CacheGenRotCodec.codec_id, CacheGenRotCodec)

__all__ = [
    "CacheGenCodec",
    "CacheGenRotCodec",
    "Codec",
    "CodecError",
    "Int8Codec",
    "RawCodec",
    "codec_names",
    "get_codec",
    "get_codec_by_id",
    "register_codec",
]
