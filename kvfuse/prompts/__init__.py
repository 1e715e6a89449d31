"""Prompts: what a request's text, messages, token ids and documents become before the engine
sees them, in the order a request is built:

- ``prompt``     a prompt as segments: ``[prefix][documents...][suffix]``
- ``encode``     pure text -> ids rules for documents and cache-breakpoint positions
- ``truncate``   which turns of a conversation to drop when it outgrows the context window
- ``builder``    ``PromptBuilder``: text, ids, chat messages and documents -> a ``Prompt``, within
                 the context window (the chat template, truncation, breakpoints)

``runtime`` builds one ``PromptBuilder`` per model and hands it to the engine, the server and the
CLI: nothing reads it through the engine.
"""

from .builder import PromptBuilder
from .prompt import Prompt, Segment, SegmentKind

__all__ = ["Prompt", "PromptBuilder", "Segment", "SegmentKind"]
