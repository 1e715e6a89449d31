"""Conversations (CachedAttention): the token ids a stored history was built from, found again
for a later turn and aligned against its prompt. (Which turns to drop when a conversation
outgrows the context window is the prompt builder's: ``kvfuse.prompts.truncate``.)

- ``align``: pure functions that line a new prompt up against stored ids (re-tokenized text,
  a modified answer, dropped turns);
- ``records``: the in-memory index of stored histories (by ``prompt_cache_key`` or by content);
- ``response_store``: the Responses API's stored responses (SQLite), each with its history record.
"""

from .align import Alignment, Run, align, byte_sync
from .records import HistoryIndex, Record, StoredEntry

__all__ = [
    "Alignment",
    "HistoryIndex",
    "Record",
    "Run",
    "StoredEntry",
    "align",
    "byte_sync",
]
